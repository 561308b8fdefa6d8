"""VerifyRequest.decode_ahead: the target decodes the steps nobody drafts for in the same exchange.

The tokens must be the ones those steps would have made one Verify at a time (greedy: the target's
own; seeded sampling: the same draws, keyed by position), and fewer exchanges must carry them.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.maths.costs import MODEL_DRAFT_PRIOR, NGRAM_DRAFT_PRIOR, CostModel
from specdec.maths.draft_length import DraftLengthPolicy
from coordinator.clients import TargetClient
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import DEFAULT_DECODE_AHEAD, SpeculativeLoop
from draft_service.drafters.ngram import NgramDrafter
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.errors import InvalidArgument
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from specdec.limits import MAX_DECODE_AHEAD
from target_service.batcher import VerifyBatcher
from specdec.maths.tree import DraftTree
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from tests import tiny
from tests.stack import Stack
from tests.test_loop import MAX_NEW, run

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=5)


def engine(pair) -> TargetEngine:
    import torch

    return TargetEngine(CausalLM(pair[0], torch.device("cpu")))


def one_at_a_time(target: TargetEngine, sequence_id: str, prompt: list[int], steps: int, sampling: SamplingConfig) -> list[int]:
    out = target.verify(VerifyCall(sequence_id, 0, prompt, [], [], sampling))
    tokens, known = [out.next_token], len(prompt)
    for _ in range(steps):
        out = target.verify(VerifyCall(sequence_id, known, [tokens[-1]], [], [], sampling))
        known += 1
        tokens.append(out.next_token)
    return tokens


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.9, top_k=20, seed=7)], ids=["greedy", "seeded"])
def test_decoded_tokens_are_the_ones_single_steps_make(pair, sampling):
    target = engine(pair)
    for n, prompt in enumerate(tiny.prompts(3, seed=21)):
        expected = one_at_a_time(target, f"single{n}", prompt, 9, sampling)
        out = target.verify(VerifyCall(f"ahead{n}", 0, prompt, [], [], sampling, decode_ahead=5))
        got = [out.next_token, *out.decoded]
        eos_cut = next((i + 1 for i, t in enumerate(got) if t == tiny.EOS), None)
        assert got == expected[: len(got)] and (len(got) == 6 or eos_cut == len(got))
        if eos_cut is None:  # the target holds all but the last token, and goes on from there
            assert out.cached_len == len(prompt) + 5
            more = target.verify(VerifyCall(f"ahead{n}", out.cached_len, [got[-1]], [], [], sampling, decode_ahead=3))
            assert [more.next_token, *more.decoded] == expected[6:10]


def test_decoding_ahead_follows_a_verified_draft_and_stops_after_eos(pair):
    target = engine(pair)
    prompt = tiny.prompts(1, seed=4)[0]
    reference = tiny.reference_greedy(pair[0], prompt, 12)
    out = target.verify(VerifyCall("s", 0, prompt, reference[:3], [], GREEDY, decode_ahead=4))
    assert out.accepted == 3 and [out.next_token, *out.decoded] == reference[3:8]
    # A sequence whose next greedy token is EOS: nothing is decoded past it.
    ending = next((p for p in tiny.prompts(40, seed=9) if tiny.reference_greedy(pair[0], p, 1) == [tiny.EOS]), None)
    if ending is not None:
        out = target.verify(VerifyCall("e", 0, ending, [], [], GREEDY, decode_ahead=6))
        assert out.next_token == tiny.EOS and out.decoded == ()


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.9, top_k=20, seed=7)], ids=["greedy", "seeded"])
def test_the_rows_of_a_pass_decode_ahead_together_with_the_tokens_single_steps_make(pair, sampling):
    target = engine(pair)
    prompts = tiny.prompts(4, seed=13)
    expected = [one_at_a_time(target, f"single{i}", p, 8, sampling) for i, p in enumerate(prompts)]
    # Unequal budgets: the pass decodes as far as the row that asked least; the rest come next exchange.
    results = target.verify_batch([VerifyCall(f"r{i}", 0, p, [], [], sampling, decode_ahead=3 + i) for i, p in enumerate(prompts)])
    for i, (result, want) in enumerate(zip(results, expected)):
        got = [result.next_token, *result.decoded]
        assert got == want[: len(got)]
        assert len(result.decoded) == 3 or tiny.EOS in got
        assert result.batch_size == len(prompts) and result.ahead_passes == len(result.decoded)
        if tiny.EOS not in got:
            more = target.verify_batch([VerifyCall(f"r{i}", result.cached_len, [got[-1]], [], [], sampling)])[0]
            assert more.next_token == want[len(got)]


def test_with_settle_the_rows_of_a_pass_leave_one_by_one_and_the_others_decode_on(pair):
    """With `settle` (the batcher's), a row whose budget is spent gets its result at once, while the
    rows that asked more decode on past it; a row whose caller is gone (`dropped`) stops alone.
    Every row's tokens are still the ones single steps make."""
    target = engine(pair)
    prompts = tiny.prompts(4, seed=13)
    expected = [one_at_a_time(target, f"single{i}", p, 10, GREEDY) for i, p in enumerate(prompts)]
    settled: list[tuple[int, object]] = []
    calls = [VerifyCall(f"s{i}", 0, p, [], [], GREEDY, decode_ahead=2 + 2 * i) for i, p in enumerate(prompts)]
    results = target.verify_batch(calls, settle=lambda index, result: settled.append((index, result)),
                                  dropped=lambda sequence_id: sequence_id == "s3")
    for i, (result, want) in enumerate(zip(results, expected)):
        got = [result.next_token, *result.decoded]
        assert got == want[: len(got)]
        if tiny.EOS not in got and i < 3:
            assert len(result.decoded) == 2 + 2 * i  # its own budget, not the smallest row's
    assert results[3].ahead_passes == 0  # dropped: it left before its first pass ahead
    # each row that left before the last pass was handed its result then, the very object returned
    early = dict(settled)
    assert set(early) >= {0, 3} - {i for i, r in enumerate(results) if tiny.EOS in (r.next_token, *r.decoded)}
    assert all(results[index] is result for index, result in settled)
    assert len(early) == len(settled)  # once each


def test_a_settling_batcher_answers_a_row_when_it_is_done_not_when_the_pass_returns(pair):
    target = engine(pair)
    first, second = [p for p in tiny.prompts(40, seed=17) if tiny.EOS not in tiny.reference_greedy(pair[0], p, 12)][:2]
    early: list[tuple[int, bool]] = []  # (row, whether the pass had returned yet) for each settle

    def verify_batch(calls, alone, settle):
        returned = [False]

        def noted(index, result):
            early.append((index, returned[0]))
            settle(index, result)

        results = target.verify_batch(calls, alone, settle=noted)
        returned[0] = True
        return results

    async def main():
        loop = asyncio.get_running_loop()
        batcher = VerifyBatcher(lambda fn, *args: loop.run_in_executor(None, fn, *args), verify_batch, window_s=0.0,
                                settles=True)
        a = await batcher.submit(VerifyCall("a", 0, first, [], [], GREEDY))
        b = await batcher.submit(VerifyCall("b", 0, second, [], [], GREEDY))
        short, long = await asyncio.gather(batcher.submit(VerifyCall("a", a.cached_len, [a.next_token], [], [], GREEDY, decode_ahead=1)),
                                           batcher.submit(VerifyCall("b", b.cached_len, [b.next_token], [], [], GREEDY, decode_ahead=8)))
        batcher.close()
        return a, b, short, long

    a, b, short, long = asyncio.run(main())
    assert early == [(0, False)]  # the short row, handed over while the long one still decoded
    assert len(short.decoded) == 1 and len(long.decoded) == 8  # the long row went past the short one's budget
    assert [a.next_token, short.next_token, *short.decoded] == tiny.reference_greedy(pair[0], first, 3)
    assert [b.next_token, long.next_token, *long.decoded] == tiny.reference_greedy(pair[0], second, 10)


def test_the_rows_of_a_pass_decode_ahead_with_their_own_lookup_drafts(pair):
    target = engine(pair)
    # Prompts that repeat themselves, so prompt lookup finds matches to draft from.
    prompts = [(p * 3)[:30] for p in tiny.prompts(3, seed=31)]
    expected = [tiny.reference_greedy(pair[0], p, 16) for p in prompts]
    calls = [VerifyCall(f"r{i}", 0, p, [], [], GREEDY, decode_ahead=12, lookup_draft_length=4, decode_ahead_passes=6)
             for i, p in enumerate(prompts)]
    results = target.verify_batch(calls)
    for result, want in zip(results, expected):
        got = [result.next_token, *result.decoded]
        assert got == want[: len(got)] and 1 <= result.ahead_passes <= 6
    assert sum(r.ahead_drafted for r in results) > 0  # the lookup drafted (and the tokens above still match)


def test_rows_with_lookup_drafts_leave_one_by_one_as_their_callers_see_them(pair):
    target = engine(pair)
    prompts = [(p * 3)[:30] for p in tiny.prompts(3, seed=31)]
    expected = [tiny.reference_greedy(pair[0], p, 16) for p in prompts]
    calls = [VerifyCall(f"k{i}", 0, p, [], [], GREEDY, decode_ahead=4 + 4 * i, lookup_draft_length=4) for i, p in enumerate(prompts)]
    settled = []
    results = target.verify_batch(calls, settle=lambda index, result: settled.append((index, result)))
    for result, want in zip(results, expected):
        got = [result.next_token, *result.decoded]
        assert result.accepted == 0 and got == want[: len(got)]  # the lookup's tokens among those made, as for a lone call
    assert settled and all(results[index] is result for index, result in settled)


def test_a_pass_decodes_nothing_ahead_unless_every_row_asks_and_no_call_waits(pair):
    target = engine(pair)
    prompts = tiny.prompts(3, seed=13)
    mixed = target.verify_batch([VerifyCall(f"m{i}", 0, p, [], [], GREEDY, decode_ahead=4 if i else 0) for i, p in enumerate(prompts)])
    assert all(r.decoded == () for r in mixed)  # the row that asked nothing would wait for the others
    crowded = target.verify_batch([VerifyCall(f"c{i}", 0, p, [], [], GREEDY, decode_ahead=4) for i, p in enumerate(prompts)],
                                  decode_ahead=False)
    assert all(r.decoded == () for r in crowded)  # other sequences active: the batcher said no
    passes = []
    waiting = target.verify_batch([VerifyCall(f"w{i}", 0, p, [], [], GREEDY, decode_ahead=4) for i, p in enumerate(prompts)],
                                  interrupt=lambda: passes.append(1) or len(passes) > 2)
    assert all(r.ahead_passes == 2 or tiny.EOS in (r.next_token, *r.decoded) for r in waiting)  # stopped when a call came
    alone = target.verify_batch([VerifyCall("alone", 0, prompts[0], [], [], GREEDY, decode_ahead=4)])
    assert len(alone[0].decoded) == 4 or tiny.EOS in (alone[0].next_token, *alone[0].decoded)
    asked = []
    cut = target.verify_batch([VerifyCall("cut", 0, prompts[0], [], [], GREEDY, decode_ahead=4)],
                              interrupt=lambda: asked.append(1) or len(asked) > 2)
    assert cut[0].ahead_passes == min(2, len(alone[0].decoded))  # a lone row stops when a call comes too
    assert [cut[0].next_token, *cut[0].decoded] == [alone[0].next_token, *alone[0].decoded][: 1 + cut[0].ahead_passes]


@pytest.mark.parametrize("call, field", [
    (VerifyCall("x", 0, [1, 2], [], [], GREEDY, decode_ahead=-1), "decode_ahead"),
    (VerifyCall("x", 0, [1, 2], [], [], GREEDY, decode_ahead=MAX_DECODE_AHEAD + 1), "decode_ahead"),
    (VerifyCall("x", 0, [1, 2], [], [], GREEDY, DraftTree([-1], [3]), decode_ahead=2), "decode_ahead"),
])
def test_bad_decode_ahead_is_invalid_argument(pair, call, field):
    target = engine(pair)
    with pytest.raises(InvalidArgument) as info:
        target._prepare(call)
    assert info.value.field == field


def test_the_batcher_lets_a_call_decode_ahead_only_while_its_sequence_is_the_only_active_one(pair):
    target = engine(pair)
    first, second = tiny.prompts(2, seed=17)

    async def main():
        loop = asyncio.get_running_loop()
        batcher = VerifyBatcher(lambda fn, *args: loop.run_in_executor(None, fn, *args), target.verify_batch, window_s=0.0)
        alone = await batcher.submit(VerifyCall("a", 0, first, [], [], GREEDY, decode_ahead=3))
        await batcher.submit(VerifyCall("b", 0, second, [], [], GREEDY))  # "b" is active from now on
        crowded = await batcher.submit(VerifyCall("a", alone.cached_len, [alone.decoded[-1]], [], [], GREEDY, decode_ahead=3))
        batcher.released("b")
        again = await batcher.submit(VerifyCall("a", crowded.cached_len, [crowded.next_token], [], [], GREEDY, decode_ahead=3))
        batcher.close()
        return alone, crowded, again

    alone, crowded, again = asyncio.run(main())
    assert len(alone.decoded) == 3 and crowded.decoded == () and len(again.decoded) == 3
    assert [alone.next_token, *alone.decoded, crowded.next_token] == tiny.reference_greedy(pair[0], first, 5)


def test_the_batcher_lets_a_pass_of_every_active_sequence_decode_ahead_together(pair):
    target = engine(pair)
    first, second = [p for p in tiny.prompts(40, seed=17) if tiny.EOS not in tiny.reference_greedy(pair[0], p, 5)][:2]

    async def main():
        loop = asyncio.get_running_loop()
        batcher = VerifyBatcher(lambda fn, *args: loop.run_in_executor(None, fn, *args), target.verify_batch, window_s=0.0)
        a = await batcher.submit(VerifyCall("a", 0, first, [], [], GREEDY))
        b = await batcher.submit(VerifyCall("b", 0, second, [], [], GREEDY))
        together = await asyncio.gather(batcher.submit(VerifyCall("a", a.cached_len, [a.next_token], [], [], GREEDY, decode_ahead=3)),
                                        batcher.submit(VerifyCall("b", b.cached_len, [b.next_token], [], [], GREEDY, decode_ahead=3)))
        batcher.close()
        return a, b, together

    a, b, (ta, tb) = asyncio.run(main())
    assert ta.batch_size == tb.batch_size == 2
    for start, step, prompt in ((a, ta, first), (b, tb, second)):
        got = [start.next_token, step.next_token, *step.decoded]
        assert got == tiny.reference_greedy(pair[0], prompt, 5) and len(step.decoded) == 3


class CountingVerifier(LocalVerifier):
    calls = 0

    def __init__(self, engine):
        super().__init__(engine)
        self.aheads: list[int] = []  # decode_ahead of each call

    async def verify(self, call):
        self.calls += 1
        self.aheads.append(call.decode_ahead)
        return await super().verify(call)


def test_speculation_off_decodes_in_chunks_with_the_targets_own_tokens(pair):
    target = engine(pair)
    for prompt in tiny.prompts(4, seed=31):
        verifier = CountingVerifier(target)
        tokens, stats = run(SpeculativeLoop(verifier, None, None, MODEL_DRAFT_PRIOR), prompt, draft_length=0)
        assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        assert verifier.calls <= -(-len(tokens) // (DEFAULT_DECODE_AHEAD + 1)) + 1
        assert stats.steps == len(tokens)  # every token still counts one target pass
        # The first token comes alone, after the prefill only; the steps after it come in chunks.
        assert verifier.aheads[0] == 0 and stats.first_step_tokens == 1 and max(verifier.aheads) > 0
        off = CountingVerifier(target)
        tokens_off, _ = run(SpeculativeLoop(off, None, None, MODEL_DRAFT_PRIOR, decode_ahead=0), prompt, draft_length=0)
        assert tokens_off == tokens and off.calls == len(tokens)  # --decode-ahead 0: one exchange a token


def test_an_ngram_draft_resting_between_asks_loses_no_token_and_saves_exchanges(pair):
    target = engine(pair)
    saved = 0
    for prompt in tiny.prompts(6, seed=41):
        verifier = CountingVerifier(target)
        loop = SpeculativeLoop(verifier, LocalProposer(DraftEngine(NgramDrafter(4, 1))), CostModel(NGRAM_DRAFT_PRIOR),
                               NGRAM_DRAFT_PRIOR, calibrated=True)
        tokens, stats = run(loop, prompt, draft_length=8)
        assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        saved += stats.steps - verifier.calls
    assert saved > 0


def test_seeded_sampling_replays_with_decoding_ahead(pair):
    target = engine(pair)
    prompt = tiny.prompts(1, seed=51)[0]
    sampling = SamplingConfig(temperature=1.0, seed=11)
    chunked, _ = run(SpeculativeLoop(LocalVerifier(target), None, None, MODEL_DRAFT_PRIOR), prompt, draft_length=0,
                     sampling=sampling, seeded=True)
    stepwise = one_at_a_time(target, "stepwise", prompt, MAX_NEW - 1, sampling)
    cut = next((i + 1 for i, t in enumerate(stepwise) if t == tiny.EOS), len(stepwise))
    assert chunked == stepwise[:cut]


def test_quiet_steps_cover_rests_and_idle_steps_and_skip_matches_plan():
    policy = DraftLengthPolicy(draft_length=8, prior=NGRAM_DRAFT_PRIOR, calibrated=True)
    policy.plan()
    policy.asked(0)
    policy.asked(0)  # two empty asks in a row: rest 2
    assert policy.quiet_steps() == 2
    policy.skip(2)
    assert policy.rest == 0 and policy.plan()[0] > 0
    assert DraftLengthPolicy(draft_length=0).quiet_steps() is None
    assert DraftLengthPolicy(draft_length=4, adaptive=False).quiet_steps() == 0
    idle = DraftLengthPolicy(draft_length=8, accepted_weight=0.01, rejected_weight=10.0)  # drafting does not pay
    assert idle.plan()[0] == 0 and idle.idle
    quiet = idle.quiet_steps()
    twin = DraftLengthPolicy(draft_length=8, accepted_weight=0.01, rejected_weight=10.0)
    twin.plan()
    idle.skip(quiet)
    for _ in range(quiet):
        assert twin.plan()[0] == 0
    assert idle.idle_steps == twin.idle_steps and idle.plan()[0] > 0 and twin.plan()[0] > 0  # both probe next


@pytest.fixture(scope="module")
def service(pair, tmp_path_factory):
    stack = Stack()
    yield stack.target(tiny.save(pair[0], tmp_path_factory.mktemp("ahead") / "target"))
    stack.stop()


def test_decoded_tokens_cross_the_wire_and_a_bad_value_names_its_field(pair, service):
    prompt = tiny.prompts(1, seed=61)[0]

    async def main():
        client = TargetClient(service, timeout_s=30)
        try:
            return await client.verify(VerifyCall("wire", 0, prompt, [], [], GREEDY, decode_ahead=4))
        finally:
            await client.close()

    out = asyncio.run(main())
    assert [out.next_token, *out.decoded] == tiny.reference_greedy(pair[0], prompt, 5)[: 1 + len(out.decoded)]
    with grpc.insecure_channel(service) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(pb.VerifyRequest(sequence_id="bad", known_len=0, append_tokens=prompt, decode_ahead=MAX_DECODE_AHEAD + 1), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "decode_ahead" in info.value.details()
