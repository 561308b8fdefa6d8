# usage: python shapes.py  (from the repository root, .venv/bin/python)
import time, torch
torch.set_num_threads(1)
from specdec.model.cpu.gemm_kernel import load
k = load()
for (K,N) in [(64,64),(256,256),(256,1024),(576,576),(576,1536),(1536,576),(576,49152)]:
    w = torch.randn(N,K); panels = k.pack(w)
    res=[]
    for M in (1,4,16):
        x = torch.randn(M,K)
        for _ in range(20): k.linear(x, panels, N, None)
        n = max(20, int(2e8/(K*N*M+1e5)))
        t=time.perf_counter()
        for _ in range(n): k.linear(x, panels, N, None)
        res.append(f"M={M}: {(time.perf_counter()-t)/n*1e6:8.1f}us")
    print(f"K={K} N={N}", *res)
