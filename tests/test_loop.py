"""The speculative loop in process (no gRPC), with faults injected between steps."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.maths.costs import MODEL_DRAFT_PRIOR, CostModel
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import GenerationSpec, Stats
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from target_service.engine import TargetEngine
from tests import tiny

MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=0)


def engines(pair):
    target_model, draft_model = pair
    cpu = torch.device("cpu")
    return TargetEngine(CausalLM(target_model, cpu)), DraftEngine(ModelDrafter(CausalLM(draft_model, cpu)))


def run(loop: SpeculativeLoop, prompt: list[int], max_new: int = MAX_NEW, **kwargs) -> tuple[list[int], Stats]:
    spec = GenerationSpec(request_id="r", prompt_ids=prompt, max_new_tokens=max_new, sampling=kwargs.pop("sampling", SamplingConfig()),
                          draft_length=kwargs.pop("draft_length", 4), adaptive=kwargs.pop("adaptive", True),
                          eos_token_ids=frozenset({tiny.EOS}), **kwargs)
    stats = Stats()

    async def collect():
        out = []
        async for step in loop.run(spec, stats):
            out.extend(step.tokens)
        return out

    return asyncio.run(collect()), stats


class EvictingVerifier(LocalVerifier):
    """Loses every sequence before every third call, as a restarted or evicting target would."""

    calls = 0

    async def verify(self, call):
        self.calls += 1
        if self.calls % 3 == 0:
            for sequence_id in list(self.engine.store._sequences):
                self.engine.store.release(sequence_id, retire=False)  # an eviction, not a Release
        return await super().verify(call)


class FlakyProposer(LocalProposer):
    """Fails on its second call and on every call after the tenth: a draft that dies."""

    calls = 0

    async def propose(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2 or self.calls > 10:
            raise ConnectionError("draft is down")
        return await super().propose(*args, **kwargs)


def test_lost_sequences_are_refilled_and_output_is_unchanged(pair):
    target, draft = engines(pair)
    for prompt in tiny.prompts(6):
        loop = SpeculativeLoop(EvictingVerifier(target), LocalProposer(draft), CostModel(MODEL_DRAFT_PRIOR), MODEL_DRAFT_PRIOR)
        tokens, stats = run(loop, prompt)
        assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW)
    assert len(target.store) == 0 and len(draft.store) == 0


def test_a_failing_draft_falls_back_to_the_target_alone(pair):
    target, draft = engines(pair)
    prompt = tiny.prompts()[2]
    proposer = FlakyProposer(draft)
    loop = SpeculativeLoop(LocalVerifier(target), proposer, None, MODEL_DRAFT_PRIOR)
    tokens, stats = run(loop, prompt)
    assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW)
    assert stats.draft_failures >= 1


def test_in_process_loop_matches_generate_for_many_lengths(pair):
    target, draft = engines(pair)
    loop = SpeculativeLoop(LocalVerifier(target), LocalProposer(draft), CostModel(MODEL_DRAFT_PRIOR), MODEL_DRAFT_PRIOR)
    for prompt in tiny.prompts(5, seed=9):
        expected = tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        for gamma in (1, 3, 8, 16):
            assert run(loop, prompt, draft_length=gamma)[0] == expected


def test_max_new_tokens_is_exact_even_when_a_step_overshoots(pair):
    target, draft = engines(pair)
    loop = SpeculativeLoop(LocalVerifier(target), LocalProposer(draft), None, MODEL_DRAFT_PRIOR)
    prompt = tiny.prompts()[0]
    for limit in (1, 2, 5):
        tokens, stats = asyncio.run(_limited(loop, prompt, limit))
        assert tokens == tiny.reference_greedy(pair[0], prompt, limit)
        assert stats.completion_tokens == len(tokens) <= limit


async def _limited(loop, prompt, limit):
    spec = GenerationSpec("r", prompt, limit, SamplingConfig(), 8, False, frozenset({tiny.EOS}))
    stats = Stats()
    out = []
    async for step in loop.run(spec, stats):
        out.extend(step.tokens)
    return out, stats


def test_the_cost_model_charges_the_draft_round_trip_to_asking_steps_only(pair):
    """A draft service's round trip (wall minus compute) is t_ask, paid only by steps that draft;
    the target exchange's is the per-step wire. Folding the first into the second made drafting
    look cheap exactly when asking cost the most."""
    import dataclasses

    class DistantProposer(LocalProposer):  # as if the draft sat 20 ms of network away
        async def propose(self, *args, **kwargs):
            outcome = await super().propose(*args, **kwargs)
            return dataclasses.replace(outcome, wall_seconds=outcome.compute_seconds + 0.020)

    target, draft = engines(pair)
    model = CostModel(MODEL_DRAFT_PRIOR)
    loop = SpeculativeLoop(LocalVerifier(target), DistantProposer(draft), model, MODEL_DRAFT_PRIOR)
    prompt = tiny.prompts()[0]
    tokens, stats = run(loop, prompt, draft_length=4, adaptive=False)
    assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW) and stats.draft_steps > 3
    costs = model.costs()
    assert costs.draft_per_ask > 0.010 and costs.wire_per_step < 0.005
    assert costs.step_seconds(1) - costs.step_seconds(0) > 0.010


def test_fixed_costs_are_what_the_cost_model_learns(pair):
    """coordinator/local.py's `fixed_costs`: each pass reports the seconds given, not the ones it
    took, and the cost model learns exactly those (the distribution tests' deterministic costs)."""
    from specdec.maths.costs import Costs, cost_curve

    fixed = Costs(draft_per_token=0.002, verify=cost_curve(0.02, 1.1, 0.001), wire_per_step=0.0005, draft_per_ask=0.0007)
    target, draft = engines(pair)
    model = CostModel(MODEL_DRAFT_PRIOR, prior_weight=1e-9)  # the readings alone
    loop = SpeculativeLoop(LocalVerifier(target, fixed_costs=fixed), LocalProposer(draft, fixed_costs=fixed), model, MODEL_DRAFT_PRIOR)
    prompt = tiny.prompts()[0]
    tokens, stats = run(loop, prompt, draft_length=4, adaptive=False)
    assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW) and stats.draft_steps > 3
    learned = model.costs()
    assert learned.draft_per_token == pytest.approx(0.002) and learned.draft_per_ask == pytest.approx(0.0007)
    assert learned.wire_per_step == pytest.approx(0.0005)
    assert learned.verify[4] == pytest.approx(fixed.verify[4])  # four draft tokens and the bonus: V(5)


class CountingProposer(LocalProposer):
    """Records each Propose as (known_len, tokens appended, max_tokens)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls: list[tuple[int, int, int]] = []

    async def propose(self, call, *args, **kwargs):
        self.calls.append((call.known_len, len(call.append), call.draft_length))
        return await super().propose(call, *args, **kwargs)


def test_steps_that_will_not_draft_never_ask_the_draft(pair):
    """Speculation on under a full batch (the load cap at 0) asks the draft nothing, and makes the
    tokens speculation off makes. Once the cap lifts, one Propose brings the draft every token made
    meanwhile (known_len and append, as after decoding ahead), and the output is still the target's."""
    target, draft = engines(pair)
    for prompt in tiny.prompts(3, seed=13):
        expected = tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        full = CostModel(MODEL_DRAFT_PRIOR)
        full.draft_cap = lambda: 0
        proposer = CountingProposer(draft)
        tokens, stats = run(SpeculativeLoop(LocalVerifier(target), proposer, full, MODEL_DRAFT_PRIOR), prompt, draft_length=8)
        off, _ = run(SpeculativeLoop(LocalVerifier(target), proposer, full, MODEL_DRAFT_PRIOR), prompt, draft_length=0)
        assert tokens == off == expected and proposer.calls == [] and stats.draft_tokens == 0 and stats.load_capped_steps

        caps = iter([7, 0, 0, 0])  # drafts once, then three steps of a full batch, then room again
        thinning = CostModel(MODEL_DRAFT_PRIOR)
        thinning.draft_cap = lambda caps=caps: next(caps, 7)
        proposer = CountingProposer(draft)
        tokens, stats = run(SpeculativeLoop(LocalVerifier(target), proposer, thinning, MODEL_DRAFT_PRIOR, decode_ahead=0),
                            prompt, draft_length=8)
        assert tokens == expected and len(proposer.calls) >= 2 and stats.load_capped_steps == 3
        (known, appended, _), (caught_up, catch_up, _) = proposer.calls[:2]
        assert (known, appended) == (0, len(prompt))
        assert caught_up > 0 and catch_up >= 3  # the capped steps' tokens arrive with the next ask, in one call


def test_a_request_that_drafts_nothing_costs_the_coordinator_what_speculation_off_does(pair):
    """The policy weighs its costs (a fit of the cost curve) only on the steps where its answer can
    change: never under a full batch, and between probes only at each probe. The coordinator runs
    every request's steps on one event loop and a batched target pass waits for all of them, so
    weighing on every step made a full batch with speculation on slower than with it off."""

    class CountingCosts(CostModel):
        weighed = 0

        def costs(self):
            self.weighed += 1
            return super().costs()

    target, draft = engines(pair)
    prompt = tiny.prompts(1, seed=17)[0]
    full = CountingCosts(MODEL_DRAFT_PRIOR)
    full.draft_cap = lambda: 0
    tokens, stats = run(SpeculativeLoop(LocalVerifier(target), LocalProposer(draft), full, MODEL_DRAFT_PRIOR, decode_ahead=0),
                        prompt, draft_length=8)
    assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW) and stats.steps == len(tokens) and full.weighed == 0
