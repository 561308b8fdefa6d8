"""Tokens of the in-process loop (off, n-gram with target lookup, the feature draft) on chat and
grounded prompts, as JSON: run against two trees (PYTHONPATH) and compare."""
import json, sys
from specdec.model.assembly import LMOptions, load_lm
from specdec.model.loading import DEFAULT_TARGET
from specdec_tools.workload import load_prompts
from specdec_tools.bench_runners import local_runner
from specdec_tools.stacks import draft_config
from draft_service.servicer import load_engine_with_model_info
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
try:
    from specdec.maths.costs import NGRAM_DRAFT_PRIOR, MODEL_DRAFT_PRIOR, CostModel
except ImportError:
    from specdec.spec.costs import NGRAM_DRAFT_PRIOR, MODEL_DRAFT_PRIOR, CostModel
from target_service.engine import TargetEngine

served = load_lm(LMOptions(DEFAULT_TARGET, weights="auto"))
lm, tok = served.lm, served.loaded.tokenizer
verifier = LocalVerifier(TargetEngine(lm))
eos = lm.eos_token_ids
prompts = [ids for _, ids in load_prompts(tok, "chat", 3) + load_prompts(tok, "grounded", 3)]
out = {"off": [local_runner(SpeculativeLoop(verifier, None, None, NGRAM_DRAFT_PRIOR), 48, eos, 0, False)(p).tokens for p in prompts]}
for drafter, prior in (("ngram", NGRAM_DRAFT_PRIOR), ("smollm2-135m-feature", MODEL_DRAFT_PRIOR)):
    engine = load_engine_with_model_info(draft_config(drafter, DEFAULT_TARGET))[0]
    ng = drafter == "ngram"
    loop = SpeculativeLoop(verifier, LocalProposer(engine), CostModel(prior), prior, features=engine.drafter.needs_features,
                           calibrated=ng, lookup=ng)
    out[drafter] = [local_runner(loop, 48, eos, 8, True)(p).tokens for p in prompts]
json.dump(out, open(sys.argv[1], "w"))
print({k: sum(map(len, v)) for k, v in out.items()}, all(v == out["off"] for v in out.values()))
