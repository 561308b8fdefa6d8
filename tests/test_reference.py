"""The reference speculative loop (specdec/maths/reference.py) as an oracle: greedy, its output is the
target decoding alone, and specdec's own loop (coordinator/loop.py over the in-process engines)
gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from specdec.maths.costs import MODEL_DRAFT_PRIOR
from specdec.maths.reference import speculative_generate
from tests import tiny
from tests.test_loop import engines, run

MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=0)


def reference(pair, prompt: list[int], k: int) -> list[int]:
    target, draft = pair
    return speculative_generate(lambda ids: target(ids).logits, lambda ids: draft(ids).logits, prompt, MAX_NEW, k,
                                eos_token_ids=frozenset({tiny.EOS}))


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_reference_is_the_target_alone(pair, k):
    for prompt in tiny.prompts(4):
        assert reference(pair, prompt, k) == tiny.reference_greedy(pair[0], prompt, MAX_NEW)


def test_specdecs_loop_gives_the_references_tokens(pair):
    target, draft = engines(pair)
    loop = SpeculativeLoop(LocalVerifier(target), LocalProposer(draft), None, MODEL_DRAFT_PRIOR)
    for prompt in tiny.prompts(4, seed=1):
        tokens, _ = run(loop, prompt, MAX_NEW, draft_length=4, adaptive=False)
        assert tokens == reference(pair, prompt, 4)


def test_a_sampled_run_repeats_with_its_generator_and_stays_in_the_vocabulary(pair):
    target, draft = pair
    prompt = tiny.prompts(1)[0]

    def sampled(seed: int) -> list[int]:
        return speculative_generate(lambda ids: target(ids).logits, lambda ids: draft(ids).logits, prompt, MAX_NEW, 3,
                                    temperature=0.8, generator=torch.Generator().manual_seed(seed))

    first = sampled(7)
    assert first == sampled(7) and 0 < len(first) <= MAX_NEW
    assert all(0 <= t < tiny.VOCAB for t in first)
