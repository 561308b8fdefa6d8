"""The draft-length policy (specdec/maths/draft_length.py) and the costs it weighs
(specdec/maths/costs.py): E(g), the best length or prefix, the running cost model and its fit."""

import pytest

from specdec.maths.draft_length import PROBE_LENGTH, AcceptanceMemory, DraftLengthPolicy
from specdec.maths.costs import (MODEL_DRAFT_PRIOR, NGRAM_DRAFT_PRIOR, CostModel, Costs, best_length, best_prefix,
                                cost_curve, expected_tokens, monotone)


def test_expected_tokens_matches_leviathan_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)


def test_best_length_grows_with_acceptance_and_shrinks_with_draft_cost():
    curve = cost_curve(1.0, 1.0, 0.1)  # GPU-like: no jump from one position to two
    cheap = Costs(0.01, curve, 0.0)
    costly = Costs(0.5, curve, 0.0)
    assert best_length(0.9, cheap, 16) > best_length(0.5, cheap, 16)
    assert best_length(0.9, costly, 16) < best_length(0.9, cheap, 16)
    assert best_length(0.05, costly, 16) == 0


def test_a_costly_second_position_turns_drafting_off_at_low_acceptance():
    cpu = Costs(0.002, cost_curve(1.0, 1.6, 0.02), 0.0)  # n-gram draft on a CPU target
    assert best_length(0.2, cpu, 8) == 0
    assert best_length(0.8, cpu, 8) >= 4


def test_policy_probes_now_and_then_when_not_drafting():
    policy = DraftLengthPolicy(draft_length=8, prior=Costs(0.002, cost_curve(1.0, 1.6, 0.02), 0.0))
    for _ in range(40):
        policy.observe(drafted=4, accepted=0)
    plans = [policy.plan()[0] for _ in range(16)]
    assert plans.count(0) == 14 and all(g == PROBE_LENGTH for g in plans if g)
    for _ in range(4):  # probes that find nothing come ever more rarely
        while policy.plan()[0] == 0:
            pass
        policy.observe(drafted=4, accepted=0)
    assert policy.probe_every == policy.max_probe_every


class CountingCosts(CostModel):
    """A cost model that counts how often a policy weighs its costs."""

    weighed = 0

    def costs(self) -> Costs:
        self.weighed += 1
        return super().costs()


def test_a_step_that_will_not_draft_weighs_no_costs():
    """The coordinator plans every step of every running request on one event loop, and a batched
    target pass waits for them all: a step that will not draft may cost no more than one without
    speculation. Weighing the costs on every such step (a fit of the cost curve) made the idle
    requests of a full batch slower than speculation off."""
    model = CountingCosts(NGRAM_DRAFT_PRIOR)
    cap = [0]
    model.draft_cap = lambda: cap[0]
    policy = DraftLengthPolicy(draft_length=8, cost_model=model, prior=NGRAM_DRAFT_PRIOR)
    for _ in range(40):  # a full batch: no draft, no probe, nothing weighed
        assert policy.plan()[0] == 0 and policy.capped and not policy.probing
        policy.observe(0, 0)
    assert model.weighed == 0 and policy.idle_steps == 0 and policy.probe_every == policy.min_probe_every
    assert policy.quiet_steps() is None  # a step without speculation: decode ahead as speculation off does
    cap[0] = 7  # the batch thinned: drafting resumes at the next step
    assert policy.plan()[0] > 0 and model.weighed == 1

    idle = DraftLengthPolicy(draft_length=8, cost_model=CountingCosts(NGRAM_DRAFT_PRIOR), prior=NGRAM_DRAFT_PRIOR,
                             accepted_weight=0.01, rejected_weight=10.0)  # drafting does not pay
    plans = []
    for _ in range(40):
        plans.append(idle.plan()[0])
        idle.observe(plans[-1], 0)
    # Probes back off as they always did (every 8, 16, then 32 steps); the costs are weighed at each
    # probe and at the step after it, which starts the next stretch, and at the first step.
    assert [i for i, g in enumerate(plans) if g] == [7, 15, 31]
    assert idle.cost_model.weighed == len([0, 7, 8, 15, 16, 31, 32])


def test_only_the_probe_step_backs_the_probes_off():
    """A probe that found nothing doubles the wait for the next one, once: the steps after it (a
    rest after its empty ask, a step the load cap left without a draft) are no probes."""
    policy = DraftLengthPolicy(draft_length=8, prior=NGRAM_DRAFT_PRIOR, calibrated=True, accepted_weight=0.01, rejected_weight=10.0)
    while policy.plan()[0] == 0:
        policy.observe(0, 0)
    assert policy.probing
    policy.asked(0)  # the probe's ask came back empty: a rest follows
    policy.observe(0, 0)
    assert policy.probe_every == 2 * policy.min_probe_every and policy.rest
    while policy.rest:
        assert policy.plan()[0] == 0
        policy.observe(0, 0)
    assert policy.probe_every == 2 * policy.min_probe_every


def test_threshold_rises_after_rejections_and_falls_after_full_accepts():
    policy = DraftLengthPolicy(draft_length=8)
    start = policy.threshold
    policy.observe(drafted=4, accepted=1)
    assert policy.threshold > start
    raised = policy.threshold
    for _ in range(3):
        policy.observe(drafted=4, accepted=4)
    assert policy.threshold < raised


def test_an_empty_draft_lowers_the_threshold_so_a_shy_draft_gets_back_in():
    policy = DraftLengthPolicy(draft_length=8)
    for _ in range(20):
        policy.observe(drafted=2, accepted=0)
    assert policy.threshold == policy.threshold_bounds[1]  # rejections alone pin it at the top
    for _ in range(5):
        policy.nothing_drafted()
    assert policy.threshold < 0.2 * policy.threshold_bounds[1]
    for _ in range(50):
        policy.nothing_drafted()
    assert policy.threshold == policy.threshold_bounds[0]


def test_acceptance_estimate_follows_observations():
    policy = DraftLengthPolicy(draft_length=8)
    for _ in range(30):
        policy.observe(drafted=8, accepted=8)
    high = policy.plan()[0]
    assert policy.acceptance > 0.9
    for _ in range(60):
        policy.observe(drafted=4, accepted=0)
    assert policy.acceptance < 0.2 and policy.plan()[0] < high


def test_non_adaptive_policy_uses_the_fixed_length():
    assert DraftLengthPolicy(draft_length=5, adaptive=False).plan() == (5, 0.0)


def test_cost_model_learns_seconds_from_steps():
    model = CostModel(MODEL_DRAFT_PRIOR)
    for _ in range(50):
        for n in (1, 3, 5):
            model.observe(drafted=n - 1, draft_seconds=0.004 * (n - 1), verified=n, verify_seconds=0.040 + 0.005 * n, wire_seconds=0.001)
    costs = model.costs()
    assert costs.draft_per_token == pytest.approx(0.004, rel=0.2)
    assert costs.verify[0] == pytest.approx(0.045, rel=0.05) and costs.verify[4] == pytest.approx(0.065, rel=0.05)
    assert costs.step_seconds(0) == pytest.approx(0.046, rel=0.05)


def test_a_calibrated_proposal_is_cut_where_expected_tokens_per_second_peak():
    flat = Costs(0.0, tuple([1.0] * 33), 0.0)  # checking more positions costs nothing: keep what has any chance
    assert best_prefix([0.9, 0.8, 0.1, 0.0], flat) == 3
    steep = Costs(0.0, cost_curve(1.0, 1.55, 0.03), 0.0)  # V(2) = 1.55 V(1), as on 2 CPU cores
    assert best_prefix([0.2, 0.1], steep) == 0  # a 1-token match, right 20% of the time: not worth a pass
    assert best_prefix([0.85, 0.77, 0.69, 0.62, 0.56], steep) == 5  # a long match runs on: verify it all
    assert best_prefix([], steep) == 0


def test_a_calibrated_policy_keeps_the_per_request_cap_and_cuts_only_when_adaptive():
    policy = DraftLengthPolicy(draft_length=8, prior=NGRAM_DRAFT_PRIOR, calibrated=True)
    uncalibrated = DraftLengthPolicy(draft_length=8, prior=NGRAM_DRAFT_PRIOR)
    for _ in range(6):  # a request whose drafts keep failing drafts less, or not at all, either way
        assert policy.plan() == uncalibrated.plan()
        policy.observe(4, 0)
        uncalibrated.observe(4, 0)
    assert policy.cut([0.1, 0.05]) == 0  # at V(2) = 1.2 V(1) plus an ask, 1.15 tokens do not pay
    assert policy.cut(None) is None
    assert DraftLengthPolicy(draft_length=8, calibrated=True, adaptive=False).cut([0.2]) is None
    assert DraftLengthPolicy(draft_length=8).cut([0.2]) is None  # uncalibrated drafts keep the threshold


def test_a_calibrated_draft_that_comes_back_empty_is_asked_ever_less_often():
    policy = DraftLengthPolicy(draft_length=8, prior=NGRAM_DRAFT_PRIOR, calibrated=True)
    waits = []
    assert policy.plan()[0] > 0
    for _ in range(5):  # five empty asks in a row: the waits between asks grow 1, 2, 4, 8, 8
        policy.asked(0)
        wait = 0
        while policy.plan()[0] == 0:
            wait += 1
        waits.append(wait)
    assert waits == [1, 2, 4, 8, 8]
    policy.asked(3)  # an ask with something to verify: the next one comes at once...
    assert policy.plan()[0] > 0
    policy.asked(0)  # ...and the waits start over
    assert policy.rest == 1
    uncalibrated = DraftLengthPolicy(draft_length=8, prior=NGRAM_DRAFT_PRIOR)
    uncalibrated.asked(0)  # a model draft's empty proposal is the threshold's business (nothing_drafted)
    assert uncalibrated.plan()[0] > 0


def test_the_fitted_cost_curve_never_falls_as_positions_grow():
    assert monotone([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([5.0, 1.0], [1, 3]) == [2.0, 2.0]  # pooled by weight
    assert monotone([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    # The case that kept a chat request drafting 5 tokens a step: the first timed step (V(1)) set
    # the prior's unit, only V(6) was measured after it, and the prior's steeper V(2..5) made every
    # shorter draft look dearer than five, so no shorter one was ever tried.
    model = CostModel(Costs(0.002, cost_curve(1.0, 1.55, 0.03), 0.03))
    for _ in range(30):
        model.observe(drafted=0, draft_seconds=0.0, verified=1, verify_seconds=0.022, wire_seconds=0.0002)
        model.observe(drafted=5, draft_seconds=0.0001, verified=6, verify_seconds=0.029, wire_seconds=0.0002)
    costs = model.costs()
    assert all(a <= b for a, b in zip(costs.verify, costs.verify[1:]))
    assert costs.verify[0] == pytest.approx(0.022, rel=0.05) and costs.verify[5] == pytest.approx(0.029, rel=0.1)
    assert costs.step_seconds(1) <= costs.step_seconds(5)


def test_asking_the_draft_costs_only_the_steps_that_draft():
    model = CostModel(NGRAM_DRAFT_PRIOR)
    for _ in range(60):
        model.observe(drafted=2, draft_seconds=0.00001, verified=3, verify_seconds=0.030, wire_seconds=0.001, ask_seconds=0.002)
        model.observe(drafted=0, draft_seconds=0.0, verified=1, verify_seconds=0.025, wire_seconds=0.001)
    costs = model.costs()
    assert costs.draft_per_ask == pytest.approx(0.002, rel=0.1) and costs.wire_per_step == pytest.approx(0.001, rel=0.1)
    assert costs.step_seconds(0) == pytest.approx(0.026, rel=0.05)
    assert costs.step_seconds(2) == pytest.approx(0.002 + 0.030 + 0.001, rel=0.05)


def test_a_burst_of_batched_readings_gives_way_to_single_stream_ones():
    """A fresh coordinator whose first steps were batched (a burst of streams) read V(1) several
    times a single stream's, the very first reading a pass padded to another row's prefill. Those
    readings fixed the seconds of the untried V(n > 1) for good, so once single streams measured
    their own V(1), V(2) stood many times above it and no proposal was worth verifying again."""
    model = CostModel(NGRAM_DRAFT_PRIOR)
    model.observe(drafted=0, draft_seconds=0.0, verified=1, verify_seconds=0.200, wire_seconds=0.001)  # padded to a prefill
    for _ in range(200):  # ten rows a pass
        model.observe(drafted=0, draft_seconds=0.0, verified=1, verify_seconds=0.050, wire_seconds=0.001)
    for _ in range(150):  # one stream, and nothing drafted: two or three requests
        model.observe(drafted=0, draft_seconds=0.0, verified=1, verify_seconds=0.010, wire_seconds=0.001, ask_seconds=0.0001)
    costs = model.costs()
    assert costs.verify[0] == pytest.approx(0.010, rel=0.1)
    prior_jump = NGRAM_DRAFT_PRIOR.verify[1] / NGRAM_DRAFT_PRIOR.verify[0]
    assert costs.verify[1] / costs.verify[0] == pytest.approx(prior_jump, rel=0.1)  # the prior's shape at today's scale
    assert best_prefix([0.9, 0.8, 0.7], costs) == 3  # a strong match is worth verifying again


def test_lengths_measured_only_in_a_burst_age_back_to_the_prior_shape():
    """With no load cap (--verify-token-budget 0) a burst measures V(n > 1) too, in batched passes.
    Kept until a draft of the same length was timed again, those readings outweighed the single
    streams' V(1) for good; aged by every step observed, they give way."""
    model = CostModel(NGRAM_DRAFT_PRIOR)
    for _ in range(100):
        for n in (1, 3, 5):
            model.observe(drafted=n - 1, draft_seconds=0.0, verified=n, verify_seconds=0.060 + 0.010 * n, wire_seconds=0.001)
    for _ in range(250):
        model.observe(drafted=0, draft_seconds=0.0, verified=1, verify_seconds=0.010, wire_seconds=0.001)
    costs = model.costs()
    assert costs.verify[0] == pytest.approx(0.010, rel=0.1)
    assert costs.verify[4] / costs.verify[0] == pytest.approx(NGRAM_DRAFT_PRIOR.verify[4] / NGRAM_DRAFT_PRIOR.verify[0], rel=0.1)


def test_the_cost_model_fits_its_readings_once_between_two_steps():
    """A step asks for the costs twice (its draft length, then its proposal's cut); the fit of the
    V(n) curve is made once, and again after the next reading."""
    model = CostModel(NGRAM_DRAFT_PRIOR)
    first = model.costs()
    assert model.costs() is first
    model.observe(0, 0.0, 1, 0.5, 0.01)
    again = model.costs()
    assert again is not first and again.verify[0] == pytest.approx(0.5) != first.verify[0] and model.costs() is again


def test_a_loop_without_a_draft_weighs_no_costs():
    """Speculation off (no draft): no step drafts, so none weighs the costs."""
    import asyncio

    from coordinator.loop import SpeculativeLoop
    from coordinator.protocol import GenerationSpec, Stats
    from specdec.calls.request import VerifyResult
    from specdec.maths.sampling import SamplingConfig

    class Instant:
        async def verify(self, call):
            return VerifyResult(0, 7, cached_len=0, compute_seconds=0.001, wall_seconds=0.0011)

        async def release(self, sequence_id):
            pass

    model = CountingCosts(NGRAM_DRAFT_PRIOR)
    loop = SpeculativeLoop(Instant(), None, model, NGRAM_DRAFT_PRIOR, decode_ahead=0)
    spec = GenerationSpec(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=20, sampling=SamplingConfig(), draft_length=8,
                          adaptive=True, eos_token_ids=frozenset())
    stats = Stats()

    async def collect():
        return [token async for step in loop.run(spec, stats) for token in step.tokens]

    assert asyncio.run(collect()) == [7] * 20 and stats.steps == 20 and model.weighed == 0


def test_a_new_request_starts_from_the_acceptance_recent_requests_saw():
    """A draft that accepts a quarter of its tokens: the first request drafts at the fixed prior's
    lengths until its verdicts say otherwise; the ones after it start where it left off and do
    not draft, while a memory of a draft that accepts nearly everything starts them drafting long."""
    cpu = Costs(0.25, cost_curve(1.0, 1.15, 0.02), 0.0)  # a model draft a quarter of a target token a token
    memory = AcceptanceMemory()
    first = DraftLengthPolicy(draft_length=8, prior=cpu, memory=memory)
    assert memory.acceptance is None and first.plan()[0] > 0  # nothing seen yet: the fixed prior drafts
    for step in range(24):
        first.observe(drafted=4, accepted=0 if step % 3 else 1)
    assert memory.acceptance == pytest.approx(0.25, abs=0.05)
    assert DraftLengthPolicy(draft_length=8, prior=cpu, memory=memory).plan()[0] == 0
    assert DraftLengthPolicy(draft_length=8, prior=cpu).plan()[0] > 0  # without it: drafts, and pays to learn

    good = AcceptanceMemory()
    for _ in range(8):
        good.observe(drafted=4, accepted=4)
    assert good.acceptance == 1.0 and DraftLengthPolicy(draft_length=8, prior=cpu, memory=good).plan()[0] >= 4
    # Seeded requests pass no memory (their lengths must not depend on earlier requests), and a
    # fixed-length request ignores it.
    assert DraftLengthPolicy(draft_length=8, prior=cpu, memory=memory, adaptive=False).plan()[0] == 8
    # Requests too short to reach a probe teach the memory nothing: each one ages it, and within
    # some tens of them one starts from the fixed prior again, drafts, and refreshes it.
    starts = [DraftLengthPolicy(draft_length=8, prior=cpu, memory=memory).plan()[0] for _ in range(40)]
    first_draft = next(i for i, g in enumerate(starts) if g > 0)
    assert 0 < first_draft < 40 and memory.acceptance is None
