# usage: python bits.py NEW.so OLD.so  (two builds of specdec/model/cpu/csrc/*.c with the kernel's flags)
import ctypes, pathlib, torch, sys
from specdec.model.cpu.gemm_kernel import Kernel
from specdec.model.cpu.compact import quantize
d = pathlib.Path.home()/'.cache/specdec/kernels'
new, old = [Kernel(ctypes.CDLL(n), pathlib.Path(n)) for n in sys.argv[1:3]]
torch.manual_seed(0); same = total = 0
for (K,N) in [(64,64),(256,1024),(576,1536),(1536,576),(100,37)]:
    w = torch.randn(N,K); b = torch.randn(N)
    for M in (1,2,3,5,7,16,17,40):
        x = torch.randn(M,K)
        total += 1; same += torch.equal(new.linear(x, new.pack(w), N, b), old.linear(x, old.pack(w), N, b))
        for kind in ('bf16','f16','int8','q4'):
            c = quantize(w, kind)
            total += 1; same += torch.equal(new.linear_compact(x, c, b), old.linear_compact(x, c, b))
print(f"{same} of {total} outputs bit-identical")
