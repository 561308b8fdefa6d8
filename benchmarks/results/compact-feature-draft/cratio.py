"""c against the target as served, interleaved: the target's decode step V(1) (gguf-a8 or fp32, as bench
measures it) and each draft variant's ms per drafted token (bench's measure_draft_cost over a draft
engine built as the draft service builds it), round after round, so machine drift hits all alike."""
import dataclasses, statistics, sys, torch
from specdec.model.cpu import gemm
from specdec.model.loading import load_model, load_tokenizer
from specdec.model.gpu.static import exact_lm
from specdec_tools.bench import measure_cost_curve, measure_draft_cost, curve_context, load_prompts
from specdec_tools.stacks import draft_config
from draft_service.loading import load_engine
torch.set_num_threads(int(sys.argv[1]))
targets = sys.argv[2].split(",")
variants = [v.split(":") for v in sys.argv[3].split(",")]  # folder:weights
rounds = int(sys.argv[4])
lms = {}
for w in targets:
    loaded = load_model("smollm2-135m-instruct", "cpu")
    gemm.apply(loaded.model, loaded.device, loaded.dtype, gemm.DEFAULT_ROWS, gemm.DEFAULT_MIN_ROWS, w, loaded.path)
    lms[w] = exact_lm(loaded.model, loaded.device)
tok = load_tokenizer("smollm2-135m-instruct")
items = load_prompts(tok, "chat", 0)
context = curve_context(items, 64, None)
engines = {}
for folder, w in variants:
    cfg = dataclasses.replace(draft_config(folder, "smollm2-135m-instruct"), weights=w)
    engines[(folder.rstrip("/").split("/")[-1], w)] = load_engine(cfg)[0]
v1 = {w: [] for w in lms}; d = {k: [] for k in engines}
for r in range(rounds):
    for w, lm in (lms.items() if r % 2 == 0 else reversed(lms.items())):
        v1[w].append(measure_cost_curve(lm, context, [1], repeats=5).single)
    for k, e in (engines.items() if r % 2 == 0 else reversed(engines.items())):
        d[k].append(measure_draft_cost(e, context, tokens=8, repeats=5))
    print("round", r, {w: round(v[-1] * 1e3, 2) for w, v in v1.items()},
          {f"{k[0]}@{k[1]}": round(v[-1] * 1e3, 2) for k, v in d.items()}, flush=True)
for w, tv in v1.items():
    print(f"target {w}: V(1) median {statistics.median(tv) * 1e3:.2f} ms (rounds {min(tv) * 1e3:.2f}-{max(tv) * 1e3:.2f})")
for k, dv in d.items():
    cs = {w: [a / b for a, b in zip(dv, v1[w])] for w in v1}
    print(f"draft {k[0]} @ {k[1]}: {statistics.median(dv) * 1e3:.2f} ms/token (rounds {min(dv) * 1e3:.2f}-{max(dv) * 1e3:.2f}); "
          + "; ".join(f"c vs {w} {statistics.median(c):.3f} (rounds {min(c):.3f}-{max(c):.3f})" for w, c in cs.items()))
