import time, torch, statistics
from specdec.model.cpu import gemm, stack
from specdec.model.loading import load_model
from specdec.model.gpu.static import exact_lm
from specdec.kv.store import Sequence
torch.set_num_threads(1)
loaded = load_model("/tmp/tiny", "cpu")
gemm.apply(loaded.model, loaded.device, loaded.dtype, gemm.DEFAULT_ROWS, gemm.DEFAULT_MIN_ROWS, "int8", loaded.path)
lm = exact_lm(loaded.model, loaded.device)
dec = lm.model.get_decoder(); st = stack.installed(dec)
seqs = []
for i in range(64):
    s = Sequence(f"s{i}", list(range(1, 101)))
    seqs.append(s)
with torch.inference_mode():
    stack.forward_rows(lm, seqs, [s.tokens[:] for s in seqs], [1]*64)
    orig = st.kernel.stack
    ts = []
    def timed(*a):
        t = time.perf_counter(); r = orig(*a); ts.append(time.perf_counter() - t); return r
    st.kernel.stack = timed
    tt = []
    for _ in range(int(__import__("os").environ.get("STEPS", "50"))):
        t = time.perf_counter()
        out = stack.forward_rows(lm, seqs, [[5] for s in seqs], [1]*64)
        tt.append(time.perf_counter() - t)
        for s in seqs: s.tokens.append(5)
print("kernel.stack ms", round(statistics.median(ts)*1e3, 3), "forward_rows ms", round(statistics.median(tt)*1e3, 3))
# one sequence of 64 rows (a chunk) vs 64 sequences of one row: the same M
s1 = Sequence("one", list(range(1, 101)))
with torch.inference_mode():
    stack.forward_rows(lm, [s1], [s1.tokens[:]], [1])
    ts.clear()
    for _ in range(20):
        stack.forward_rows(lm, [s1], [[5]*64], [1]); s1.tokens += [5]*64; s1.crop_cache(len(s1.tokens)-64); s1.tokens = s1.tokens[:-64]
print("one seq x 64 rows: kernel.stack ms", round(statistics.median(ts)*1e3, 3))
