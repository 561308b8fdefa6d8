import dataclasses, statistics, time, torch
from specdec.model.loading import load_tokenizer
from specdec.model.features import FeatureRows
from specdec.calls.request import ProposeCall
from specdec_tools.workload import load_prompts
from specdec_tools.stacks import draft_config
from draft_service.loading import load_engine
torch.set_num_threads(2)
tok = load_tokenizer("smollm2-135m-instruct")
prompts = [ids for _, ids in load_prompts(tok, "grounded", 0)]
cfg = dataclasses.replace(draft_config("specdec/drafts/smollm2-135m-feature", "smollm2-135m-instruct"), weights="auto")
e, info = load_engine(cfg)
torch.manual_seed(0)
ts = []
for r in range(3):
    for i, ids in enumerate(prompts):
        feats = FeatureRows(0, torch.randn(len(ids) - 1, e.drafter.feature_dim))
        s = time.perf_counter()
        list(e.propose(ProposeCall(f"s{r}-{i}", 0, list(ids), 1, features=feats)))
        ts.append(time.perf_counter() - s)
        e.release(f"s{r}-{i}")
print("prompt lengths", [len(p) for p in prompts])
per_pair = statistics.median(ts) / statistics.median([len(p) for p in prompts])
print("prefill ms median", round(statistics.median(ts) * 1e3, 1), "per pair us", round(per_pair * 1e6, 1))
