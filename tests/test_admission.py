"""Admission under load (coordinator/policy/admission.py): running cap, bounded queue, prompt refusal with
a retry hint, cancellation while queued, and the draft-length cap that shrinks as the batch fills."""

from __future__ import annotations

import asyncio

import pytest

from specdec.maths.costs import NGRAM_DRAFT_PRIOR, CostModel
from specdec.maths.draft_length import DraftLengthPolicy
from coordinator.policy.admission import Admission
from specdec.errors import Overloaded


def test_running_cap_queue_and_prompt_refusal():
    async def main():
        admission = Admission(max_running=2, max_queue=1)
        release = asyncio.Event()
        order = []

        async def request(name):
            async with admission.slot():
                order.append(name)
                await release.wait()

        running = [asyncio.ensure_future(request(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.01)
        assert (admission.running, admission.queued, order) == (2, 1, ["a", "b"])
        with pytest.raises(Overloaded) as refused:
            async with admission.slot():
                pass
        assert 0.05 <= refused.value.retry_after_s <= 60 and "max_queue=1" in str(refused.value)
        release.set()
        await asyncio.gather(*running)
        assert order == ["a", "b", "c"] and admission.running == 0 and admission.queued == 0

    asyncio.run(main())


def test_a_request_cancelled_while_queued_frees_its_place():
    async def main():
        admission = Admission(max_running=1, max_queue=2)
        release = asyncio.Event()

        async def request():
            async with admission.slot():
                await release.wait()

        first, queued, second = (asyncio.ensure_future(request()) for _ in range(3))
        await asyncio.sleep(0.01)
        queued.cancel()
        await asyncio.sleep(0.01)
        assert admission.queued == 1
        release.set()
        await asyncio.gather(first, second)
        assert admission.running == 0 and admission.queued == 0

    asyncio.run(main())


def test_queue_depth_is_reported_on_every_change():
    """What feeds the specdec:num_requests_waiting gauge: joins, a cancel while queued, hand-overs."""
    depths = []

    async def main():
        admission = Admission(max_running=1, max_queue=3, on_queue=depths.append)
        release = asyncio.Event()

        async def request():
            async with admission.slot():
                await release.wait()

        first, cancelled, second = (asyncio.ensure_future(request()) for _ in range(3))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert depths == [1, 2, 1, 0] and depths[-1] == 0


def test_queue_time_is_the_wait_for_a_slot():
    """What feeds specdec:request_queue_time_seconds: ~0 for a request that found a slot free, the
    time until the running one ended for a queued one; nothing for a request cancelled while queued."""
    waits = []
    hold_s = 0.2

    async def main():
        admission = Admission(max_running=1, max_queue=3, on_admit=waits.append)

        async def request(hold: float):
            async with admission.slot():
                await asyncio.sleep(hold)

        first = asyncio.ensure_future(request(hold_s))
        await asyncio.sleep(0)
        cancelled, second = asyncio.ensure_future(request(0)), asyncio.ensure_future(request(0))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert len(waits) == 2
    assert waits[0] < 0.05 and waits[1] >= hold_s - 0.01


def test_draft_length_shrinks_as_the_batch_fills():
    admission = Admission(max_running=0, max_queue=0, verify_token_budget=16)
    caps = []
    for running in (1, 2, 4, 8, 16):
        admission.running = running
        caps.append(admission.draft_cap())
    assert caps == [15, 7, 3, 1, 0]
    model = CostModel(NGRAM_DRAFT_PRIOR)
    model.draft_cap = admission.draft_cap
    policy = DraftLengthPolicy(draft_length=8, cost_model=model, prior=NGRAM_DRAFT_PRIOR, accepted_weight=50.0)
    admission.running = 1
    assert policy.plan()[0] == 8 and not policy.capped  # high acceptance, alone: the full draft length
    admission.running = 4
    assert policy.plan()[0] == 3 and not policy.capped
    admission.running = 16
    assert policy.plan()[0] == 0 and policy.capped  # full batch: no speculation, probes included; the stats say why
    assert Admission(1, 1, verify_token_budget=0).draft_cap() >= 32


def test_steps_the_load_cap_left_without_a_draft_are_reported(tmp_path):
    """--verify-token-budget 1 leaves no room for a draft token even for one request: speculation is
    off by load at every step, and the response statistics and /metrics say so."""
    import urllib.request

    from protos import specdec_pb2 as pb
    from tests import tiny
    from tests.stack import Stack

    stack = Stack()
    try:
        address, base, _ = stack.tiny_speculative(tmp_path, verify_token_budget=1)
        stats = stack.client(address).Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=tiny.prompts(1)[0]), max_new_tokens=8),
                                               timeout=60).stats
        assert stats.draft_tokens == 0 and 0 < stats.load_capped_steps <= stats.steps
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert "specdec:spec_decode_load_capped_steps" in metrics
    finally:
        stack.stop()


def test_budget_minus_one_is_read_off_the_measured_cost_curve():
    """-1: the knee of the target's V(n) (specdec.maths.costs.knee): 8 on the CPU prior's curve, far more
    on a flat (GPU-like) one, and 8 until a cost model is attached."""
    from specdec.maths.costs import MODEL_DRAFT_PRIOR, Costs, knee

    assert knee(MODEL_DRAFT_PRIOR) == 8
    flat = Costs(0.001, tuple(0.003 + 1e-6 * n for n in range(len(MODEL_DRAFT_PRIOR.verify))), 0.0)
    assert knee(flat) == 256
    steep = Costs(0.001, tuple(0.003 * (1 + n) for n in range(len(MODEL_DRAFT_PRIOR.verify))), 0.0)
    assert knee(steep) == 1
    admission = Admission(max_running=0, max_queue=0, verify_token_budget=-1)
    admission.running = 4
    assert admission.draft_cap() == 8 // 4 - 1
    admission.measured_budget = lambda: knee(flat)
    assert admission.draft_cap() == 256 // 4 - 1
    with pytest.raises(ValueError):
        Admission(1, 1, verify_token_budget=-3)


def test_the_default_budget_is_the_knee_the_target_timed_at_its_start(tmp_path):
    """-2 (the default): the target times a few passes at start-up and reports its knee in
    ModelInfo.verify_knee; the coordinator shares that among its running requests."""
    from tests.stack import Stack

    stack = Stack()
    try:
        stack.tiny_speculative(tmp_path)
        coordinator = stack.servers[-1].servicer
        knee = coordinator.target_info.verify_knee
        assert knee >= 1
        assert coordinator.config.verify_token_budget == -2 and coordinator.admission.measured_budget() == knee
    finally:
        stack.stop()


def test_a_target_times_its_knee_and_reports_none_where_it_cannot():
    """pass_knee on a tiny model: a knee, and the engine holds no sequence after it; a context too
    short for the timing's 32-token prefix: 0 (not measured), never an error."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.model.lm import CausalLM
    from target_service.engine import TargetEngine

    torch.manual_seed(0)
    for context, measured in ((512, True), (32, False)):
        config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=context)
        engine = TargetEngine(CausalLM(LlamaForCausalLM(config).eval(), torch.device("cpu")))
        knee = engine.pass_knee(repeats=1)
        assert (knee >= 1) if measured else knee == 0
        assert len(engine.store) == 0


def test_the_knee_of_a_few_timed_passes():
    """knee_of_passes draws the curve straight between the sizes timed: the CPU figures of
    benchmarks/results/avx2-bench-gguf (ms) give 3, an H200's exact pass (2.67 ms for one position,
    3.10 for 16, 3.8 for 64) far more, and a curve past 1.5x from the first step gives 1."""
    from specdec.maths.costs import knee_of_passes

    assert knee_of_passes({1: 12.1, 2: 14.7, 4: 20.7, 8: 44.1}) == 3
    assert knee_of_passes({1: 2.67, 4: 2.75, 16: 3.10, 64: 3.8}) > 64
    assert knee_of_passes({1: 1.0, 2: 2.0, 4: 4.0}) == 1
    with pytest.raises(ValueError):
        knee_of_passes({2: 1.0})


def test_partial_prefills_are_bounded_and_short_prompts_pass_long_ones():
    """vLLM's partial-prefill bounds (issue 55): prompts longer than the target's chunk (100 here)
    hold at most 2 prefill places, those longer than 500 at most 1; a request over its bound waits
    without a running slot, the long ones start in the order they came, and a short one starts at once."""
    async def main():
        admission = Admission(max_running=8, max_queue=8, max_partial_prefills=2, max_long_partial_prefills=1,
                              long_prefill_tokens=500, prefill_chunk_tokens=100)
        started: list[str] = []
        holds: dict[str, object] = {}
        done = {name: asyncio.Event() for name in "ABCDEFG"}

        async def request(name, tokens):
            async with admission.slot(tokens) as admitted:
                started.append(name)
                holds[name] = admitted
                await done[name].wait()

        async def arrive(name, tokens):
            task = asyncio.ensure_future(request(name, tokens))
            await asyncio.sleep(0.01)
            return task

        tasks = [await arrive("A", 2000), await arrive("B", 2000), await arrive("C", 10), await arrive("D", 200),
                 await arrive("E", 300), await arrive("F", 2000)]
        assert started == ["A", "C", "D"] and admission.queued == 3  # B (long) and E (partial) wait; C passed B
        assert admission.running == 3, "a request waiting for a prefill place holds no running slot"
        holds["A"].prefilled()  # A's first token: its long place goes to B, the next long in order
        await asyncio.sleep(0.01)
        assert started == ["A", "C", "D", "B"]
        holds["D"].prefilled()
        await asyncio.sleep(0.01)
        assert started == ["A", "C", "D", "B", "E"]
        tasks.append(await arrive("G", 2000))
        done["B"].set()  # B ends before its first token (an error): its places go too, to F, then G
        await asyncio.sleep(0.01)
        assert started == ["A", "C", "D", "B", "E", "F"]
        holds["F"].prefilled()
        await asyncio.sleep(0.01)
        assert started[-1] == "G"
        for event in done.values():
            event.set()
        await asyncio.gather(*tasks)
        assert (admission.running, admission.partial, admission.long, admission.queued) == (0, 0, 0, 0)

    asyncio.run(main())


def test_a_long_prompt_cancelled_while_waiting_for_its_place_leaks_nothing():
    async def main():
        admission = Admission(max_running=4, max_queue=4, max_partial_prefills=1, max_long_partial_prefills=1,
                              long_prefill_tokens=500, prefill_chunk_tokens=100)
        release = asyncio.Event()

        async def request(tokens):
            async with admission.slot(tokens):
                await release.wait()

        first = asyncio.ensure_future(request(1000))
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(request(1000))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert admission.queued == 0 and admission.running == 1 and admission.long == 1
        release.set()
        await first
        assert (admission.running, admission.partial, admission.long) == (0, 0, 0)

    asyncio.run(main())
