"""VerifyRequest.lookup_max_tokens: on the passes without a draft of their own, the target drafts by
prompt lookup itself (specdec/maths/lookup.py), so an n-gram step costs no exchange.

Greedy tokens must be exactly the target's own, whatever was drafted; the accepted drafts must
save forward passes; the coordinator must ask for it only where it keeps its guarantees (an n-gram
drafter, not seeded sampling), and a bad value must name its field. The sampled distribution with
it is checked in tests/test_distribution_drafters.py (test_ngram_drafted_by_the_target).
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from coordinator.clients import TargetClient
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from draft_service.drafters.ngram import NgramDrafter
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.errors import InvalidArgument
from specdec.model.lm import CausalLM
from specdec.limits import MAX_DECODE_AHEAD
from specdec.maths.costs import NGRAM_DRAFT_PRIOR, CostModel
from specdec.maths.lookup import (MAX_LOOKUP_REST, MatchCalibration, MatchOdds, NgramIndex, best_cut, looked, lookup_draft,
                                  relative_costs, rests)
from specdec.calls.request import VerifyCall
from specdec.maths.sampling import SamplingConfig
from target_service.engine import PassCosts, TargetEngine
from tests import tiny
from tests.stack import Stack
from tests.test_loop import MAX_NEW, run

GREEDY = SamplingConfig()
MOST = 8


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=5)


def engine(pair) -> TargetEngine:
    return TargetEngine(CausalLM(pair[0], torch.device("cpu")))


def echoing_prompts(pair, n: int) -> list[list[int]]:
    """x, the target's continuation of x, then x again: the target often continues the second x as
    it did the first, which prompt lookup proposes (a tiny random model's text rarely repeats otherwise)."""
    return [x + tiny.reference_greedy(pair[0], x, 12) + x for x in tiny.prompts(n, seed=21)]


def test_lookup_draft_is_cut_where_expected_tokens_per_cost_peak():
    index = NgramIndex(4, 1)
    index.extend([7, 8, 9, 5, 7, 8])  # suffix (7, 8) matched: 9, 5, 7, 8, ... followed it
    calibration = MatchCalibration(4)
    assert lookup_draft(index, calibration, 3, (), room=10) == ([9, 5, 7], [9, 5, 7], 2)  # no costs: no cut
    assert lookup_draft(index, calibration, 8, (), room=2)[0] == [9, 5]
    assert lookup_draft(NgramIndex(4, 1), calibration, 8, (), room=10) == ([], [], 0)
    flat, dearer = (1.0,) * 9, tuple(1.0 + 0.2 * n for n in range(9))
    assert best_cut([0.9, 0.8, 0.7], flat) == 3  # free positions: all of it
    assert best_cut([0.2, 0.1], dearer) == 0 and best_cut([0.99, 0.98], dearer) == 2
    # A match length whose drafts keep failing is cut to nothing once the calibration has seen it.
    curve = relative_costs(NGRAM_DRAFT_PRIOR, 8)
    assert curve[0] == 1.0 and len(curve) == 9
    before = len(lookup_draft(index, calibration, 8, curve, room=10)[0])
    for _ in range(50):
        calibration.observe(2, [9, 5, 7], [1])
    assert before > 0 and lookup_draft(index, calibration, 8, curve, room=10)[0] == []


def test_the_shortcut_past_a_first_token_too_unlikely_to_pay_cuts_as_best_cut_does():
    """lookup_draft skips working out a match's chances when its first token cannot pay for one
    drafted position (pays_from): the draft it returns is the one best_cut picks, on every case."""
    rng = random.Random(3)
    for _ in range(400):
        index = NgramIndex(4, 1)
        index.extend([rng.randrange(4) for _ in range(rng.randrange(2, 40))])
        calibration = MatchCalibration(4, prior_weight=rng.choice((0.5, 4.0)))
        for _ in range(rng.randrange(30)):
            n = rng.randrange(1, 5)
            calibration.observe(n, [1, 2, 3], [1, 2, 3][: rng.randrange(4)] + [9], index.odds if rng.random() < 0.5 else None)
        step = rng.choice((0.0, 0.05, 0.3, 0.9, 1.5))
        relative = tuple(1.0 + step * g ** rng.choice((1.0, 0.7)) for g in range(rng.randrange(1, 9)))
        got = lookup_draft(index, calibration, 8, relative, room=10)
        proposal, n = index.propose(8)
        full = proposal[: best_cut(calibration.survival(n, len(proposal), index.odds), relative)] if n else []
        assert got[0] == full and got[1:] == ((proposal, n) if n else ([], 0))


def test_a_lookup_that_drafts_nothing_rests_the_next_ones_1_2_4_then_8_passes():
    """Among rows sharing a pass, a sequence whose lookups draft nothing skips its next lookups
    (rests), doubling the rest each time up to MAX_LOOKUP_REST; a draft ends the rests. After a
    rest the index catches up indexing only the last tokens: matches into the rested stretch are
    lost (fewer drafts), the rest stays found."""
    index = NgramIndex(4, 1)
    skipped = []
    for _ in range(4):
        looked(index, 0)
        count = 0
        while rests(index):
            count += 1
        skipped.append(count)
    assert skipped == [1, 2, 4, MAX_LOOKUP_REST]
    looked(index, 2)
    assert not rests(index) and index.empties == 0
    index = NgramIndex(4, 1)
    index.extend([1, 2, 3, 4, 5])
    index.extend([6, 7, 8, 9, 10, 11, 1, 2], indexed=3)  # 6..10 not indexed: (8, 9) has no continuation
    index.extend([8, 9])
    assert index.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 8, 9] and index.propose(2) == ([], 0)
    index.extend([1, 2, 3])  # (1, 2, 3), indexed before the rest, is still found: 4, 5 follow it
    assert index.propose(2) == ([4, 5], 3)
    index.crop(-10)  # back into the stretch left out, whose tokens roll back as the others do
    assert index.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and index.propose(1) == ([], 0)


def test_rows_that_rest_their_lookups_still_get_the_targets_own_tokens(pair):
    """Decoding ahead among several rows, with rests: every row's tokens are the ones decoding alone
    gives, and a lone row never rests."""
    target = engine(pair)
    prompts = tiny.prompts(6, seed=5)
    batch = target.verify_batch([VerifyCall(f"b{n}", 0, p, [], [], GREEDY, decode_ahead=24, lookup_draft_length=MOST,
                                            lookup_costs=(1.0, 3.0, 5.0, 7.0, 9.0))  # a position: 2 passes' worth
                                 for n, p in enumerate(prompts)])
    for prompt, out in zip(prompts, batch):
        got = [out.next_token, *out.decoded]
        assert out.accepted == 0 and got == tiny.reference_greedy(pair[0], prompt, len(got))
    sides = {seq.sequence_id: seq.side for seq in target.store}
    assert any(sides[f"b{n}"].empties for n in range(len(prompts)))
    alone = target.verify(VerifyCall("lone", 0, prompts[0], [], [], GREEDY, decode_ahead=24, lookup_draft_length=MOST,
                                     lookup_costs=(1.0, 3.0, 5.0, 7.0, 9.0)))
    assert [alone.next_token, *alone.decoded][:5] == [batch[0].next_token, *batch[0].decoded][:5]
    assert {seq.sequence_id: seq.side for seq in target.store}["lone"].rest == 0


def test_a_sequence_whose_matches_keep_missing_stops_drafting_them_on_the_others_odds():
    """The calibration is shared; a sequence's own first-token misses (drafted or not: the truth is
    known either way) lower its chances, so its 1-token matches stop being drafted while another
    sequence's, on the same shared table, still are. Hits bring the factor back."""
    calibration = MatchCalibration(4)
    curve = (1.0, 1.135, 1.26, 1.53, 1.85)  # an fp32 target on 2 cores
    unlucky, fresh = NgramIndex(4, 1), NgramIndex(4, 1)
    for index in (unlucky, fresh):
        index.extend([5, 1, 2, 5])  # the last 5 matches once (n = 1): 1, 2, 5 are proposed
    assert lookup_draft(fresh, calibration, 4, curve, room=10)[0] == [1]  # the shared odds: worth one token
    others = MatchOdds()
    for _ in range(12):  # this sequence's 1-token matches miss; the others' are right one time in four
        calibration.observe(1, [1, 2, 5], [9], unlucky.odds)
        for truth in ([1, 2, 5], [9], [9], [9]):
            calibration.observe(1, [1, 2, 5], truth, others)
    assert unlucky.odds.factor() < 0.5
    assert lookup_draft(unlucky, calibration, 4, curve, room=10)[0] == []
    assert lookup_draft(fresh, calibration, 4, curve, room=10)[0][:1] == [1]  # the shared table still drafts it
    for _ in range(30):
        calibration.observe(1, [1, 2, 5], [1, 2, 5], unlucky.odds)
    assert unlucky.odds.factor() > 1 and lookup_draft(unlucky, calibration, 4, curve, room=10)[0]
    odds = MatchOdds()
    assert odds.factor() == 1.0
    assert calibration.survival(1, 3, odds) == calibration.survival(1, 3)


def test_pass_costs_read_what_a_position_adds_to_a_forward():
    costs = PassCosts()
    assert costs.lookup_costs(1, 3) == ()  # one row: its caller's costs hold
    assert costs.lookup_costs(8, 2) == (1.0, 2.0, 3.0)  # nothing measured: a position costs a share
    for _ in range(3):  # a 2-core CPU's forwards: 1 row 10 ms, 8 rows 21 ms, 16 positions 28, 32 positions 49
        for positions, seconds in ((1, 0.0100), (8, 0.0209), (16, 0.0283), (32, 0.0494)):
            costs.observe(positions, seconds)
    a, b = costs.line()
    assert 0.007 < a < 0.011 and 0.0011 < b < 0.0014
    share = (a + 8 * b) / 8  # one of 8 rows
    assert costs.lookup_costs(8, 2) == pytest.approx((1.0, 1 + b / share, 1 + 2 * b / share))
    flat = PassCosts()
    for _ in range(20):
        flat.observe(8, 0.02)
    assert flat.line() is None  # every forward as long: no slope to read


def test_pass_costs_leave_one_ask_in_some_to_the_caller_while_they_cannot_say():
    costs = PassCosts()
    asks = [costs.lookup_costs(8, 2) for _ in range(2 * PassCosts.EXPLORE_EVERY)]
    assert asks.count(()) == 2 and asks.count((1.0, 2.0, 3.0)) == len(asks) - 2


def test_the_pass_costs_learn_where_every_batched_pass_decodes_ahead(pair):
    """Under a steady load every batched pass decodes ahead, each row one position a pass while the
    cautious default cuts its lookup draft: the passes it takes still teach the line, since they
    are observed and a few rows' drafts are left to their callers' costs. (An outside audit found
    the line still empty after thousands of requests: neither was so.) Tokens stay the target's own."""
    target = engine(pair)
    prompts = [(p * 3)[:30] for p in tiny.prompts(6, seed=31)]
    expected = [tiny.reference_greedy(pair[0], p, 64) for p in prompts]
    sent = [list(p) for p in prompts]  # what each sequence's next call builds on
    known, append = [0] * len(prompts), [list(p) for p in prompts]
    for _ in range(4):
        calls = [VerifyCall(f"r{i}", known[i], append[i], [], [], GREEDY, decode_ahead=8, decode_ahead_passes=8,
                            lookup_draft_length=4, lookup_costs=(1.0,) * 5) for i in range(len(prompts))]
        for i, result in enumerate(target.verify_batch(calls)):
            got = [result.next_token, *result.decoded]
            made = len(sent[i]) - len(prompts[i])
            assert got == expected[i][made: made + len(got)]
            sent[i] += got
            known[i], append[i] = result.cached_len, [got[-1]]
    assert target.pass_costs.line() is not None


def test_a_lookup_draft_beside_other_rows_pays_for_what_its_positions_add_to_the_pass(pair):
    """Alone, a row's lookup draft is cut by its caller's costs; among 8 rows, where a drafted
    position costs about a row's share of the pass, the same draft is not worth verifying."""
    target = engine(pair)
    prompt = echoing_prompts(pair, 1)[0]
    call = VerifyCall("x", 0, prompt, [], [], GREEDY, lookup_draft_length=4, lookup_costs=(1.0,) * 5)
    seq = target._prepare(call)  # the prompt ends as it began: its start's continuation is proposed
    alone = target._with_lookup(call, seq, rows=1).draft_tokens
    for _ in range(3):  # a fixed cost of 1 ms, 5 ms a position: a full pass is all positions
        for positions in (1, 4, 8, 16):
            target.pass_costs.observe(positions, 0.001 + 0.005 * positions)
    assert len(alone) == 4 and target._with_lookup(call, seq, rows=8).draft_tokens == []
    cheap = PassCosts()  # positions next to free (a GPU until compute binds): the caller's costs hold
    for _ in range(3):
        for positions in (1, 4, 8, 16):
            cheap.observe(positions, 0.001 + 1e-7 * positions)
    target.pass_costs = cheap
    assert seq.side.rest == 1  # the empty lookup among 8 rows rests the next one (rests)
    seq.side.rest = 0
    assert target._with_lookup(call, seq, rows=8).draft_tokens == alone


def test_a_lone_rows_sizes_it_has_timed_replace_its_callers_figures():
    costs = PassCosts()
    caller = (1.0, 1.2, 1.25, 1.3, 1.35)
    assert costs.lone_costs(caller) == caller  # nothing timed: the caller's
    assert costs.lone_costs(()) == ()  # a fixed draft length: no cut either way
    for _ in range(4):  # an fp32 target on 2 cores: 1, 2 and 4 positions
        for positions, seconds in ((1, 0.084), (2, 0.095), (4, 0.128)):
            costs.observe_lone(positions, seconds)
    got = costs.lone_costs(caller)
    # timed sizes are its own; 3 positions, never timed, keeps the caller's 1.25; 5 positions
    # (caller 1.35) may not cost less than the 4 it holds more than
    assert got == pytest.approx((1.0, 0.095 / 0.084, 1.25, 0.128 / 0.084, 0.128 / 0.084))
    costs.observe_lone(40, 1.0)  # past any verify pass: ignored
    assert costs.lone_costs(caller) == got


def test_a_lone_rows_lookup_draft_is_cut_by_what_its_own_passes_cost(pair):
    """A caller that never times a step hands on its priors; the target's own lone passes correct
    them: where 2 or more positions cost twice one, the draft a cheap prior allowed is not verified.
    Passes decoded ahead are what teaches it."""
    target = engine(pair)
    prompt = echoing_prompts(pair, 1)[0]
    call = VerifyCall("x", 0, prompt, [], [], GREEDY, lookup_draft_length=4, lookup_costs=(1.0, 1.01, 1.02, 1.03, 1.04))
    seq = target._prepare(call)
    assert len(target._with_lookup(call, seq, rows=1).draft_tokens) == 4
    for _ in range(4):
        for positions in range(1, 6):
            target.pass_costs.observe_lone(positions, 0.01 if positions == 1 else 0.02 * positions)
    assert target._with_lookup(call, seq, rows=1).draft_tokens == []
    fresh = engine(pair)
    ahead = VerifyCall("y", 0, prompt, [], [], GREEDY, decode_ahead=8, decode_ahead_passes=8, lookup_draft_length=4,
                       lookup_costs=(1.0,) * 5)
    fresh.verify_batch([ahead])
    assert fresh.pass_costs._lone[1][0] + sum(cell[0] for cell in fresh.pass_costs._lone[2:]) >= 4  # the passes ahead were timed


def test_greedy_tokens_are_the_targets_own_and_accepted_drafts_save_passes(pair):
    target = engine(pair)
    accepted = saved = 0
    for n, prompt in enumerate(echoing_prompts(pair, 6)):
        out = target.verify(VerifyCall(f"s{n}", 0, prompt, [], [], GREEDY, decode_ahead=12, lookup_draft_length=MOST))
        got = [out.next_token, *out.decoded]
        assert got == tiny.reference_greedy(pair[0], prompt, len(got))
        assert out.cached_len == len(prompt) + len(out.decoded)  # it holds all but the last token
        assert out.ahead_accepted <= out.ahead_drafted and out.ahead_passes + out.ahead_accepted == len(out.decoded)
        accepted += out.ahead_accepted
        saved += len(out.decoded) - out.ahead_passes
        if tiny.EOS not in got:  # and goes on from there, its index following the sequence
            more = target.verify(VerifyCall(f"s{n}", out.cached_len, [got[-1]], [], [], GREEDY, decode_ahead=6,
                                            lookup_draft_length=MOST))
            reference = tiny.reference_greedy(pair[0], prompt, len(got) + 7)
            assert [more.next_token, *more.decoded] == reference[len(got):len(got) + 1 + len(more.decoded)]
            seq = target.store._sequences[f"s{n}"]
            assert seq.side.tokens == seq.tokens[: len(seq.side.tokens)]
    assert accepted > 0 and saved == accepted


def test_a_call_without_a_draft_gets_the_targets_own_and_so_does_each_row_of_a_batch(pair):
    """The call's own pass drafts by lookup too when the caller sent no draft; the caller knows no
    draft tokens, so the accepted ones come back as next_token and decoded_tokens. In a batch
    (its rows decoding ahead together) each row drafts for itself, and gets what it gets alone."""
    target = engine(pair)
    prompts = echoing_prompts(pair, 6)
    drafted = 0
    for n, prompt in enumerate(prompts):
        out = target.verify(VerifyCall(f"m{n}", 0, prompt, [], [], GREEDY, lookup_draft_length=MOST))
        got = [out.next_token, *out.decoded]
        assert out.accepted == 0 and got == tiny.reference_greedy(pair[0], prompt, len(got))
        assert out.ahead_passes == 0 and len(out.decoded) == out.ahead_accepted
        drafted += out.ahead_drafted
    assert drafted > 0
    batch = target.verify_batch([VerifyCall(f"b{n}", 0, p, [], [], GREEDY, decode_ahead=4, decode_ahead_passes=2,
                                            lookup_draft_length=MOST) for n, p in enumerate(prompts)])
    for n, (prompt, out) in enumerate(zip(prompts, batch)):
        alone = target.verify(VerifyCall(f"a{n}", 0, prompt, [], [], GREEDY, decode_ahead=4, decode_ahead_passes=2,
                                         lookup_draft_length=MOST))
        assert (out.next_token, out.decoded, out.ahead_drafted) == (alone.next_token, alone.decoded, alone.ahead_drafted)


def test_the_passes_decoded_ahead_stop_at_decode_ahead_passes(pair):
    target = engine(pair)
    for n, prompt in enumerate(echoing_prompts(pair, 3)):
        out = target.verify(VerifyCall(f"p{n}", 0, prompt, [], [], GREEDY, decode_ahead=40, decode_ahead_passes=3,
                                       lookup_draft_length=MOST))
        got = [out.next_token, *out.decoded]
        assert got == tiny.reference_greedy(pair[0], prompt, len(got))
        assert out.ahead_passes == 3 or tiny.EOS in got


def test_a_sequence_rolled_back_and_regrown_drafts_from_its_new_tokens(pair):
    """A call without lookup may roll the sequence back and append other tokens: the index must not
    keep the n-grams of the tokens that are gone."""
    target = engine(pair)
    prompt = echoing_prompts(pair, 1)[0]
    first = target.verify(VerifyCall("r", 0, prompt, [], [], GREEDY, decode_ahead=8, lookup_draft_length=MOST))
    other = tiny.prompts(1, seed=99)[0][:5]
    known = len(prompt) - 3
    target.verify(VerifyCall("r", known, other, [], [], GREEDY))  # a rollback past the indexed tokens
    regrown = prompt[:known] + other
    out = target.verify(VerifyCall("r", len(regrown), [], [], [], GREEDY, decode_ahead=8, lookup_draft_length=MOST))
    seq = target.store._sequences["r"]
    assert seq.side.tokens == seq.tokens[: len(seq.side.tokens)] and first.cached_len > known
    # the store keeps one pending token: the call re-scores the last one, as any plain Verify would
    got = [out.next_token, *out.decoded]
    assert got == tiny.reference_greedy(pair[0], regrown, len(got))


@pytest.mark.parametrize("fields, name", [
    (dict(lookup_draft_length=-1), "lookup_max_tokens"), (dict(lookup_draft_length=33), "lookup_max_tokens"),
    (dict(lookup_draft_length=4, return_features=True), "lookup_max_tokens"),
    (dict(lookup_draft_length=4, lookup_costs=(1.0, 0.0)), "lookup_costs"),
    (dict(lookup_draft_length=4, lookup_costs=(1.0, float("nan"))), "lookup_costs"),
    (dict(lookup_draft_length=4, lookup_costs=(1.0,) * 34), "lookup_costs"),
    (dict(decode_ahead_passes=-1), "decode_ahead_passes"), (dict(decode_ahead_passes=MAX_DECODE_AHEAD + 1), "decode_ahead_passes"),
])
def test_bad_lookup_fields_are_invalid_argument(pair, fields, name):
    with pytest.raises(InvalidArgument) as info:
        engine(pair)._prepare(VerifyCall("x", 0, [1, 2], [], [], GREEDY, decode_ahead=4, **fields))
    assert info.value.field == name


class RecordingVerifier(LocalVerifier):
    def __init__(self, engine):
        super().__init__(engine)
        self.calls: list[VerifyCall] = []
        self.outcomes: list = []

    async def verify(self, call):
        self.calls.append(call)
        self.outcomes.append(await super().verify(call))
        return self.outcomes[-1]


class CountingProposer(LocalProposer):
    asks = 0

    async def propose(self, *args, **kwargs):
        self.asks += 1
        return await super().propose(*args, **kwargs)


def ngram_loop(verifier, lookup: bool, proposer: LocalProposer | None = None) -> SpeculativeLoop:
    proposer = proposer or LocalProposer(DraftEngine(NgramDrafter(4, 1)))
    return SpeculativeLoop(verifier, proposer, CostModel(NGRAM_DRAFT_PRIOR), NGRAM_DRAFT_PRIOR, calibrated=True, lookup=lookup)


def test_the_loop_with_lookup_gives_the_targets_tokens_in_fewer_exchanges(pair):
    target = engine(pair)
    exchanges = {True: 0, False: 0}
    for prompt in echoing_prompts(pair, 4):
        reference = tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        for lookup in (True, False):
            verifier, proposer = RecordingVerifier(target), CountingProposer(DraftEngine(NgramDrafter(4, 1)))
            tokens, stats = run(ngram_loop(verifier, lookup, proposer), prompt, draft_length=8)
            assert tokens == reference
            assert all(bool(call.lookup_draft_length) == lookup for call in verifier.calls)
            assert (proposer.asks == 0) == lookup  # with lookup the target drafts: the draft is never asked
            exchanges[lookup] += len(verifier.calls)
            assert stats.accepted_tokens <= stats.draft_tokens and stats.steps <= len(tokens)
    assert exchanges[True] < exchanges[False]


def test_seeded_sampling_and_a_loop_without_ngram_never_ask_for_lookup(pair):
    target = engine(pair)
    prompt = echoing_prompts(pair, 1)[0]
    verifier = RecordingVerifier(target)
    run(ngram_loop(verifier, True), prompt, draft_length=8, sampling=SamplingConfig(temperature=1.0, seed=3), seeded=True)
    assert not any(call.lookup_draft_length for call in verifier.calls)
    unseeded = RecordingVerifier(target)
    run(ngram_loop(unseeded, True), prompt, draft_length=8, sampling=SamplingConfig(temperature=1.0, seed=3))
    assert any(call.lookup_draft_length for call in unseeded.calls)
    plain = RecordingVerifier(target)
    run(SpeculativeLoop(plain, None, None, NGRAM_DRAFT_PRIOR, lookup=True), prompt, draft_length=0)
    assert not any(call.lookup_draft_length for call in plain.calls)


@pytest.fixture(scope="module")
def service(pair, tmp_path_factory):
    stack = Stack()
    yield stack.target(tiny.save(pair[0], tmp_path_factory.mktemp("lookup") / "target"))
    stack.stop()


def test_lookup_crosses_the_wire_and_a_bad_value_names_its_field(pair, service):
    prompt = echoing_prompts(pair, 1)[0]

    async def main():
        client = TargetClient(service, timeout_s=30)
        try:
            return await client.verify(VerifyCall("wire", 0, prompt, [], [], GREEDY, decode_ahead=12, lookup_draft_length=MOST))
        finally:
            await client.close()

    out = asyncio.run(main())
    got = [out.next_token, *out.decoded]
    assert got == tiny.reference_greedy(pair[0], prompt, len(got)) and out.ahead_passes + out.ahead_accepted == len(out.decoded)
    assert out.ahead_drafted > 0
    with grpc.insecure_channel(service) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(pb.VerifyRequest(sequence_id="bad", known_len=0, append_tokens=prompt, decode_ahead=4,
                                         lookup_max_tokens=40), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lookup_max_tokens" in info.value.details()


def run_steps(loop: SpeculativeLoop, prompt: list[int], **spec_fields):
    """The loop's Steps for one greedy request (tests.test_loop.run keeps only the tokens)."""
    from coordinator.protocol import GenerationSpec, Stats

    spec = GenerationSpec(request_id="r", prompt_ids=prompt, max_new_tokens=MAX_NEW, sampling=GREEDY, draft_length=8,
                          adaptive=True, eos_token_ids=frozenset({tiny.EOS}), **spec_fields)

    async def collect():
        return [step async for step in loop.run(spec, Stats())]

    return asyncio.run(collect())


def test_logprobs_and_min_tokens_hold_with_lookup(pair):
    """Each token made canonical by the target's own drafts gets its log-probability, in order, and a
    request's min_tokens bans end-of-sequence on those passes too."""
    target = engine(pair)
    for prompt in echoing_prompts(pair, 3):
        steps = {lookup: run_steps(ngram_loop(RecordingVerifier(target), lookup), prompt, logprobs=2)
                 for lookup in (True, False)}
        for got in steps.values():
            tokens = [t for step in got for t in step.tokens]
            assert tokens == tiny.reference_greedy(pair[0], prompt, MAX_NEW)
            assert [lp.token_id for step in got for lp in step.logprobs] == tokens
            assert all(len(lp.top) == 2 and lp.logprob <= 0 for step in got for lp in step.logprobs)
        with_lookup = [lp.logprob for step in steps[True] for lp in step.logprobs]
        without = [lp.logprob for step in steps[False] for lp in step.logprobs]
        assert with_lookup == pytest.approx(without, abs=1e-4)
    # prompts whose greedy continuation ends within MAX_NEW tokens: banned, the end moves past MAX_NEW
    xs = tiny.prompts(40, seed=21)
    for x in (xs[15], xs[29]):
        prompt = x + tiny.reference_greedy(pair[0], x, 12) + x
        reference = tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        end = reference.index(tiny.EOS)
        banned = [t for step in run_steps(ngram_loop(RecordingVerifier(target), True), prompt, min_tokens=MAX_NEW)
                  for t in step.tokens]
        assert tiny.EOS not in banned and len(banned) == MAX_NEW and banned[:end] == reference[:end]
