# usage: python cshapes.py bf16,f16,int8,q4  (from the repository root, .venv/bin/python)
import time, torch, sys
torch.set_num_threads(1)
from specdec.model.cpu.gemm_kernel import load
from specdec.model.cpu.compact import quantize
k = load()
torch.manual_seed(0)
for kind in sys.argv[1].split(','):
  for (K,N) in [(256,1024),(576,1536),(576,49152)]:
    w = torch.randn(N,K); c = quantize(w, kind)
    res=[]
    for M in (1,2,5,16,40):
        x = torch.randn(M,K)
        for _ in range(5): y=k.linear_compact(x, c, None)
        n = max(10, int(1e8/(K*N*M+1e5)))
        t=time.perf_counter()
        for _ in range(n): k.linear_compact(x, c, None)
        res.append(f"M={M}: {(time.perf_counter()-t)/n*1e6:8.1f}us")
    print(f"{kind} K={K} N={N}", *res, f"sum={float(y.sum()):.6f}")
