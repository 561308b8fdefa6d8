"""Tree verification on the real default target (SmolLM2-135M-Instruct): slow.

The tiny test models share the real target's architecture family, but the real one has its own
head layout (9 query heads over 3 key/value heads), RoPE scaling and 30 layers: greedy decoding
with random trees (one branch planted with the reference, others random) must still give exactly
transformers' own greedy output, alone and batched with chain rows.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.model.lm import CausalLM
from specdec.model.loading import DEFAULT_TARGET, load_model
from specdec.maths.sampling import SamplingConfig
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from tests.test_tree_engine import random_tree

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Name three primary colours."]
MAX_NEW = 24


@pytest.fixture(scope="module")
def real():
    return load_model(DEFAULT_TARGET, device="cpu")


@pytest.mark.parametrize("batched", [pytest.param(False, marks=pytest.mark.ci), True])
def test_greedy_trees_on_the_real_target_match_generate(real, batched):
    engine = TargetEngine(CausalLM(real.model, real.device))
    rng = random.Random(1)
    eos = set(engine.lm.eos_token_ids)
    states = []
    for prompt in PROMPTS:
        ids = real.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.inference_mode():
            out = real.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
        states.append({"prompt": ids, "ref": out[0, len(ids):].tolist(), "tokens": list(ids), "known": 0})
    for _ in range(MAX_NEW):
        live = [i for i, s in enumerate(states) if len(s["tokens"]) - len(s["prompt"]) < len(s["ref"]) and s["tokens"][-1] not in eos]
        if not live:
            break
        calls = []
        for i in live:
            s = states[i]
            at = len(s["tokens"]) - len(s["prompt"])
            tree = random_tree(rng, rng.choice([3, 8, 16]), s["ref"][at:])
            calls.append(VerifyCall(f"r{i}", s["known"], s["tokens"][s["known"]:], [], [], SamplingConfig(), tree))
        if batched:
            calls.append(VerifyCall("chain", 0, states[0]["prompt"], states[0]["ref"][:3], [], SamplingConfig()))  # a chain row too
            results = engine.verify_batch(calls)[:len(live)]
            engine.release("chain")
        else:
            results = [engine.verify_tree(call) for call in calls]
        for i, call, result in zip(live, calls, results):
            s = states[i]
            s["tokens"] += [call.tree.tokens[j] for j in result.path] + [result.next_token]
            s["known"] = result.cached_len
    for s in states:
        generated = s["tokens"][len(s["prompt"]):]
        assert generated[:len(s["ref"])] == s["ref"][:len(generated)] and len(generated) >= min(len(s["ref"]), MAX_NEW)
