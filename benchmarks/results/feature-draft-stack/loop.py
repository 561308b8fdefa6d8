import dataclasses, statistics, sys, time, torch
from specdec.model.loading import load_tokenizer
from specdec.model.features import FeatureRows
from specdec.calls.request import ProposeCall
from specdec_tools.bench import curve_context, load_prompts
from specdec_tools.stacks import draft_config
from draft_service.loading import load_engine
torch.set_num_threads(2)
tok = load_tokenizer("smollm2-135m-instruct")
context = curve_context(load_prompts(tok, "chat", 0), 64, None)
folder = sys.argv[1] if len(sys.argv) > 1 else "specdec/drafts/smollm2-135m-feature"
cfg = dataclasses.replace(draft_config(folder, "smollm2-135m-instruct"), weights="auto")
e, info = load_engine(cfg)
torch.manual_seed(0)
feats = FeatureRows(0, torch.randn(len(context) - 1, e.drafter.feature_dim))
list(e.propose(ProposeCall("s", 0, list(context), 1, features=feats)))
secs = float(sys.argv[2]) if len(sys.argv) > 2 else 0
times = []; out = None
t0 = time.time()
while True:
    s = time.perf_counter()
    made = list(e.propose(ProposeCall("s", len(context), [], 8)))
    times.append((time.perf_counter() - s) / len(made))
    out = out or [p.token for p in made]
    if len(times) >= 30 and time.time() - t0 > secs: break
print("tokens", out)
print("ms/token median", round(statistics.median(times) * 1e3, 3), "min", round(min(times) * 1e3, 3), "n", len(times))
