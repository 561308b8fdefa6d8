"""KV rollback: after any mix of propose / verify / rollback, cached logits equal a fresh forward."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.calls.request import ProposeCall
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from specdec.errors import SequenceNotFound, SequenceReleased
from specdec.kv.store import SequenceStore
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from tests import tiny

# fp32 logits of a fresh forward and of an incrementally built, cropped cache differ only by
# reduction order; 1e-4 absolute is far above that and far below any real mismatch (~1e-1).
ATOL = 1e-4


@pytest.fixture(scope="module")
def models():
    return tiny.tiny_pair(seed=3)


def fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def test_random_propose_verify_rollback_keeps_caches_exact(models):
    target_model, draft_model = models
    target = TargetEngine(CausalLM(target_model, torch.device("cpu")))
    draft = DraftEngine(ModelDrafter(CausalLM(draft_model, torch.device("cpu"))))
    rng = random.Random(0)
    canonical = [rng.randrange(256) for _ in range(12)]
    draft_known = target_known = 0
    for step in range(40):
        gamma = rng.randrange(0, 6)
        proposals = [p.token for p in draft.propose(ProposeCall("s", draft_known, canonical[draft_known:], gamma, 0.0, 0.0, step))]
        result = target.verify(VerifyCall("s", target_known, canonical[target_known:], proposals, [], SamplingConfig()))
        target_known = len(canonical) + result.accepted
        draft_known = len(canonical) + result.accepted if proposals else len(canonical)
        canonical += proposals[: result.accepted] + [result.next_token]
        if rng.random() < 0.2:  # a coordinator rolling back further than the last verdict
            cut = rng.randrange(1, len(canonical))
            canonical, draft_known, target_known = canonical[:cut], min(draft_known, cut), min(target_known, cut)
        for engine, known, model in ((target, target_known, target_model), (draft, draft_known, draft_model)):
            seq = engine.store.sync("s", known, canonical[known:])
            cached = engine.drafter.lm.forward(seq)[0] if engine is draft else engine.lm.forward(seq)[0]
            torch.testing.assert_close(cached, fresh_logits(model, canonical), atol=ATOL, rtol=0)
        draft_known = target_known = len(canonical)


def test_target_greedy_step_equals_argmax_of_fresh_forward(models):
    target_model, _ = models
    engine = TargetEngine(CausalLM(target_model, torch.device("cpu")))
    prompt = [5, 6, 7, 8, 9]
    result = engine.verify(VerifyCall("t", 0, prompt, [], [], SamplingConfig()))
    assert result.accepted == 0 and result.cached_len == len(prompt)
    assert result.next_token == int(fresh_logits(target_model, prompt).argmax())


def test_store_reports_lost_sequences_and_evicts_least_recent():
    store = SequenceStore(max_sequences=2)
    store.sync("a", 0, [1, 2, 3])
    with pytest.raises(SequenceNotFound, match="unknown"):
        store.sync("unknown", 4, [1])
    with pytest.raises(SequenceNotFound, match="fewer than known_len"):
        store.sync("a", 10, [1])
    store.sync("b", 0, [1])
    store.sync("a", 3, [4])  # a is now the most recent
    store.sync("c", 0, [1])  # evicts b
    assert "b" not in store and "a" in store and "c" in store
    assert store.release("a") and not store.release("a")


def test_a_call_arriving_after_its_release_cannot_recreate_the_sequence():
    store = SequenceStore(max_sequences=4)
    assert not store.release("late")  # the Release overtook the sequence's first call on the wire
    with pytest.raises(SequenceReleased, match="was released"):
        store.sync("late", 0, [1, 2])
    assert len(store) == 0
    store.sync("warm", 0, [1])
    store.release("warm", retire=False)  # warm-ups reuse their id
    store.sync("warm", 0, [1])


def test_store_expires_idle_sequences(monkeypatch):
    store = SequenceStore(max_sequences=4, idle_timeout_s=10)
    clock = [100.0]
    monkeypatch.setattr("specdec.kv.store.time.monotonic", lambda: clock[0])
    store.sync("old", 0, [1])
    clock[0] += 11
    store.sync("new", 0, [1])
    assert "old" not in store and "new" in store
