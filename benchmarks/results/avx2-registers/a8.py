# usage: python a8.py  (from the repository root, .venv/bin/python)
import time, torch
torch.set_num_threads(1)
from specdec.model.cpu.gemm_kernel import load
from specdec.model.cpu.compact import quantize, to_a8
k = load(); torch.manual_seed(0)
for (K,N) in [(576,576),(576,1536),(1536,576),(576,8192)]:
    w = torch.randn(N,K); res=[]
    for kind in ('int8','int8-a8','q4','q4-a8'):
        c = to_a8(quantize(w, kind[:-3])) if kind.endswith('-a8') else quantize(w, kind)
        for M in (1,4):
            x = torch.randn(M,K)
            for _ in range(5): k.linear_compact(x, c, None)
            n=200; t=time.perf_counter()
            for _ in range(n): k.linear_compact(x, c, None)
            res.append(f"{kind} M{M} {(time.perf_counter()-t)/n*1e6:6.1f}")
    print(K,N,' | '.join(res))
