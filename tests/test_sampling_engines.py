"""Losslessness through the real engines: a tiny-vocabulary draft model proposes, the target
verifies, and the first two emitted tokens follow the target's warped distribution.

The maths itself is tested with 40,000 samples per position in test_verify.py; this test checks
the plumbing around it (sparse p on the wire, seeding, caches) with 4,000 independent requests of
one step each (each step costs three tiny forwards, ~10 ms): enough to catch any wrong p or q,
whose biases are large. Chi-square per position, false-alarm probability 1e-4 each.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.calls.request import ProposeCall
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig, derive_seed, target_probs
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine

VOCAB, SAMPLES, FALSE_ALARM = 12, 4_000, 1e-4


def tiny(seed: int, like: LlamaForCausalLM | None = None) -> LlamaForCausalLM:
    """A 12-token model; with `like`, a noisy copy of it (a draft that agrees about half the time)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.5)
    model = LlamaForCausalLM(config).eval()
    if like is not None:
        with torch.no_grad():
            for mine, theirs in zip(model.parameters(), like.parameters()):
                mine.copy_(theirs + 0.6 * mine)
    return model


@pytest.mark.slow  # test-all: the suite's time; test_distribution checks these settings through the whole loop
def test_engines_sample_exactly_the_target_distribution():
    target_model = tiny(0)
    draft_model = tiny(1, like=target_model)
    cpu = torch.device("cpu")
    target = TargetEngine(CausalLM(target_model, cpu))
    draft = DraftEngine(ModelDrafter(CausalLM(draft_model, cpu), top_k=6))  # truncated p, still exact
    sampling_base = dict(temperature=0.9, top_k=8, top_p=0.9)
    prompt = [3, 1, 4]
    first, second = [], []
    accepted_total = 0
    for seed in range(SAMPLES):
        sampling = SamplingConfig(seed=seed, **sampling_base)
        proposals = list(draft.propose(ProposeCall("s", 0, prompt, 2, 0.0, sampling.temperature, derive_seed(seed, 3, "draft"))))
        tokens = [p.token for p in proposals]
        dists = [p.dist for p in proposals]
        result = target.verify(VerifyCall("s", 0, prompt, tokens, dists, sampling))
        emitted = tokens[: result.accepted] + [result.next_token]
        accepted_total += result.accepted
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append((emitted[0], emitted[1]))

    with torch.inference_mode():
        q0 = target_probs(target_model(torch.tensor([prompt])).logits[0, -1], SamplingConfig(**sampling_base))
    assert 0.1 * SAMPLES < accepted_total < 1.9 * SAMPLES  # both accepts and rejections happened
    assert chi_square_pvalue(first, q0) > FALSE_ALARM

    # Second position, conditioned on the most frequent first token.
    top_first = max(set(t for t, _ in second), key=lambda t: sum(1 for f, _ in second if f == t))
    with torch.inference_mode():
        q1 = target_probs(target_model(torch.tensor([prompt + [top_first]])).logits[0, -1], SamplingConfig(**sampling_base))
    conditioned = [s for f, s in second if f == top_first]
    assert len(conditioned) > 300
    assert chi_square_pvalue(conditioned, q1) > FALSE_ALARM


def chi_square_pvalue(tokens: list[int], q: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    support = q > 0
    assert counts[~support].sum() == 0, "a token outside the target's top-k / top-p support was emitted"
    kept = q[support].double()
    expected = kept / kept.sum() * counts[support].sum()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)
