"""The speculative loop: propose -> verify -> roll back, over any proposer and verifier.

It owns the canonical tokens of one request, and for each service the length of the canonical
prefix that service is known to hold (`draft_known`, `target_known`, in coordinator/state.py).
Every call sends only the canonical tokens past that point; the service crops anything beyond it
(the rejected drafts) first.
The proposer and verifier are protocols (coordinator/protocol.py): gRPC clients in production,
in-process engines in benchmarks, so the same loop runs with or without the network.
What a step leaves behind (accounting.py), the releases at a request's end (releases.py) and the
next step's draft running during a Verify (runahead.py) are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import structlog

from specdec.maths.costs import CostModel, Costs
from specdec.maths.draft_length import AcceptanceMemory, DraftLengthPolicy
from coordinator.accounting import Accounting, _finish
from coordinator.policy.overlap import RunAheadPolicy
from coordinator.protocol import DecodeRun, Decoder, DraftOutcome, GenerationSpec, Progress, Proposer, Stats, Verifier
from coordinator.releases import Releases
from coordinator.runahead import RunAhead, _part
from coordinator.state import SequenceState
from specdec.errors import SequenceNotFound, Unavailable
from specdec.limits import MAX_DECODE_AHEAD
from specdec.serving import metrics
from specdec.model.features import FeatureLog
from specdec.calls.request import ProposeCall, TreeSettings, VerifyCall, VerifyResult
from specdec.maths.lookup import relative_costs
from specdec.maths.sampling import TokenLogprob, derive_seed
from specdec.maths.tree import DraftTree

log = structlog.get_logger(__name__)


def _refilled(service: str, sequence_id: str) -> None:
    """A service lost the sequence (a restart, an eviction, a fleet's replica gone): it is sent whole."""
    log.info("re-filling a sequence the service lost", service=service, sequence_id=sequence_id)
    metrics.coordinator().refills.labels(service).inc()


@dataclasses.dataclass(frozen=True)
class Step:
    """Tokens one target pass made final; `finish_reason` ("length" / "eos") on the last step."""

    tokens: list[int]
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] = ()  # with GenerationSpec.logprobs: one per token


@dataclasses.dataclass
class Turn:
    """One step in flight: what its phases decide, handed from one to the next."""

    remaining: int  # tokens the request may still produce
    policy_draft_length: int  # the draft length the policy chose (a run-ahead drafts the next step's with it)
    min_prob: float  # ... and the cumulative probability a draft must keep
    draft_length: int  # this step's: the policy's, within the request's tokens and context
    draft: DraftOutcome = dataclasses.field(default_factory=lambda: DraftOutcome([], [], 0.0, 0.0))
    draft_wall: float | None = None  # set when the draft was asked this step (not a run-ahead's tokens)
    from_ahead: bool = False  # the draft is the last step's run-ahead
    runahead: RunAhead | None = None  # the next step's draft, drafting during this Verify
    decode_ahead: int = 0  # tokens the target may decode after this step's
    lookup: tuple[int, tuple[float, ...]] = (0, ())  # the target drafts by prompt lookup: (draft length, relative costs)


# After the draft fails, decode this many steps with the target alone before trying it again.
DRAFT_RETRY_STEPS = 16
# Default of the most tokens the target decodes ahead in one exchange when no step drafts (no draft,
# or speculation off): the exchange's cost is spread over 9 tokens, and a stream still gets tokens
# every 9 forwards. (The contract's bound is specdec.limits.MAX_DECODE_AHEAD.)
DEFAULT_DECODE_AHEAD = 8


class SpeculativeLoop(Accounting, Releases):
    def __init__(self, verifier: Verifier, proposer: Proposer | None, cost_model: CostModel | None, prior: Costs,
                 overlap: str = "off", features: bool = False, calibrated: bool = False, decode_ahead: int = DEFAULT_DECODE_AHEAD,
                 lookup: bool = False, decoder: Decoder | None = None, target_drafts: bool = False, stream_interval: int = 1):
        """`overlap`: off, auto or on: whether the draft drafts the next step while the target
        verifies this one (coordinator/policy/overlap.py). `features`: the draft drafts from the target's
        hidden states (specdec/model/feature_draft.py), so every Verify asks for them and the next Propose
        carries the ones the draft lacks. `calibrated`: the draft's cumulative probabilities are
        calibrated chances of acceptance (the n-gram drafter), so each unseeded adaptive proposal
        is cut where its expected tokens per second peak (specdec/maths/costs.py). `decode_ahead`: the
        most tokens the target may decode in one exchange for steps that will not draft (0: none).
        `lookup`: the draft is prompt lookup (n-gram), which the target runs itself on every pass:
        an unseeded chain request then asks no draft, and each exchange carries up to
        `decode_ahead` passes, so an n-gram step costs no exchange (the exchange, not the forward,
        is most of a step once the forward is fast). `decoder`: the target runs a request whose
        drafts need no draft service (prompt lookup, or none) itself, to its end (`_decode`).
        `target_drafts`: the target has a draft service of its own (ModelInfo.draft), so a request
        drafting with a model is one run too, the target asking the draft each step.
        `stream_interval`: a run's tokens come from the target in bursts of this many (its first
        token at once), each burst one message on every hop: fewer messages a token under load."""
        RunAheadPolicy(overlap)  # validates the mode
        self.verifier = verifier
        self.proposer = proposer
        self.cost_model = cost_model
        self.prior = prior
        self.acceptance = AcceptanceMemory()  # where a new request's acceptance estimate starts
        self.overlap = overlap
        self.features = features and proposer is not None
        self.calibrated = calibrated
        self.decode_ahead = decode_ahead
        self.lookup = lookup and proposer is not None and not self.features
        self.decoder = decoder
        self.target_drafts = target_drafts and decoder is not None
        self._lookup_memo: tuple[object, int, tuple[float, ...]] = (None, 0, ())
        self.stream_interval = stream_interval

    async def run(self, spec: GenerationSpec, stats: Stats) -> AsyncIterator[Step]:
        """Yields each step's new tokens until max_new_tokens or end-of-sequence.

        The phases of a step share the request's SequenceState and hand the step's own decisions
        on in a Turn. Both services' sequences are released however the generator ends (finished,
        error, cancelled, or closed early by a stop string).
        """
        if spec.tree is not None and (spec.logprobs is not None or spec.min_tokens):
            # Verify returns log-probabilities, and bans tokens, for chains only
            spec = dataclasses.replace(spec, tree=None)
        state = self._begin(spec, stats)
        if self._decodes_alone(spec, state):
            async with contextlib.aclosing(self._decode(spec, state, stats)) as steps:
                async for step in steps:
                    yield step
            return
        try:
            while True:
                turn = self._plan(spec, state)
                stats.load_capped_steps += state.lengths.capped
                await self._draft(spec, state, stats, turn)
                self._overlap(spec, state, stats, turn)
                verdict = await self._verify_draft(spec, state, turn)
                new, finish = self._commit(spec, state, stats, turn, verdict)
                await self._settle(state, stats, turn, verdict, finish)
                yield self._advance(state, stats, new, finish, verdict)
                if finish:
                    return
        finally:
            stats.total_seconds = time.perf_counter() - state.started
            await self._release(state.sequence_id)

    def _decodes_alone(self, spec: GenerationSpec, state: SequenceState) -> bool:
        """Whether the target runs this request to its end itself: a chain whose every pass either
        drafts by the target's own prompt lookup or drafts nothing (no draft, or none asked)."""
        if self.decoder is None or spec.tree is not None:
            return False
        if state.lookup or self.proposer is None or spec.draft_length == 0:
            return True
        # a model draft: the target asks its own draft service, pipelined with --overlap on (auto
        # weighs each request's bets as the step loop runs them)
        return self.target_drafts and state.ahead.mode in ("off", "on")

    def _drafted_by_target(self, spec: GenerationSpec, state: SequenceState) -> bool:
        return not state.lookup and self.proposer is not None and spec.draft_length > 0

    async def _decode(self, spec: GenerationSpec, state: SequenceState, stats: Stats) -> AsyncIterator[Step]:
        """The request as one run in the target (target_service/runs.py): no exchange between its
        passes, the tokens as each pass makes them. The tokens are the ones the step loop's Verify
        calls would make (the same calls, run by the target); a target that lost the run (a
        restart, a broken stream) gets it again from the canonical tokens, under a new sequence id
        (the old one may still be being released), while `decoder.retry_s` allows."""
        lookup = self._lookup(state) if state.lookup else (0, ())
        base, restarts, give_up, pause = state.sequence_id, 0, None, 0.0
        while True:
            run = DecodeRun(state.sequence_id, list(state.tokens), spec.sampling, spec.max_new_tokens - state.generated,
                            spec.eos_token_ids,
                            eos_banned_until=len(spec.prompt_ids) + spec.min_tokens if spec.min_tokens else 0,
                            logprobs=spec.logprobs, lookup_draft_length=lookup[0], lookup_costs=lookup[1],
                            lookup_source=spec.prediction_ids if state.lookup else (),
                            draft_length=spec.draft_length if self._drafted_by_target(spec, state) else 0,
                            adaptive=spec.adaptive, seeded=spec.seeded, features=self.features,
                            overlap=state.ahead.mode == "on", report_every=self.stream_interval)
            try:
                ending: list[int] = []  # the last tokens, held until the run's end brings its costs
                async with contextlib.aclosing(self.decoder.decode(run)) as progress:
                    async for made in progress:
                        stats.steps += made.passes
                        stats.draft_tokens += made.drafted
                        stats.accepted_tokens += made.accepted
                        stats.prediction_tokens += made.predicted_drafted
                        stats.accepted_prediction_tokens += made.predicted_accepted
                        stats.verify_seconds += made.compute_seconds
                        stats.wire_bytes += made.wire_bytes
                        if not made.tokens and not made.done:
                            continue
                        new, finish = _finish([*ending, *made.tokens], spec.eos_token_ids, spec.max_new_tokens - state.generated)
                        if made.done and finish is None:  # ended by the target's context
                            finish = "length"
                        if finish and not made.done:  # the target's run ends with these too: its end follows at once
                            ending = new
                            continue
                        state.tokens.extend(new)
                        now = time.perf_counter()
                        if not stats.completion_tokens and new:
                            stats.time_to_first_token_seconds, stats.first_step_tokens = now - state.started, len(new)
                        stats.completion_tokens += len(new)
                        stats.total_seconds = now - state.started
                        yield Step(new, finish, made.logprobs[:len(new)])
                        if finish:
                            return
                return
            except SequenceNotFound as exc:
                now = time.monotonic()
                give_up = give_up or now + self.decoder.retry_s
                if now + pause > give_up:  # the target stayed away: the client may retry elsewhere
                    raise Unavailable(f"the target lost the request's run and did not take it back: {exc}") from exc
                _refilled("target", state.sequence_id)
                log.info("the target lost a run; starting it again", reason=str(exc), pause_s=pause)
                await asyncio.sleep(pause)
                restarts, pause = restarts + 1, min(2 * pause or 0.05, 1.0)
                state.sequence_id = f"{base}:r{restarts}"
            finally:
                stats.total_seconds = time.perf_counter() - state.started

    def _begin(self, spec: GenerationSpec, stats: Stats) -> SequenceState:
        started = time.perf_counter()
        stats.prompt_tokens = len(spec.prompt_ids)
        lengths = DraftLengthPolicy(
            # Without a draft no step drafts: a policy weighing the costs every step would only cost time.
            draft_length=spec.draft_length if self.proposer is not None else 0,
            cost_model=None if spec.seeded else self.cost_model,
            prior=self.prior,
            adaptive=spec.adaptive,
            # seeded runs keep the static lengths: a cut learned online would change their draws
            calibrated=self.calibrated and not spec.seeded and spec.tree is None,
            # static costs (a test's fixed prior) keep static lengths too, as seeded requests do
            memory=None if spec.seeded or self.cost_model is None else self.acceptance,
        )
        # Run-ahead only for chains, and not for seeded sampling: its draws come from other
        # generator states than a sequential run's, and a seeded run must replay exactly.
        reproducible = spec.seeded and not spec.sampling.greedy
        ahead = RunAheadPolicy("off" if spec.tree is not None or reproducible or self.proposer is None else self.overlap)
        # Not for seeded sampling: a pass with a lookup draft draws otherwise than one with the
        # draft service's, and whether the target decodes ahead depends on the load (it does only
        # for a sequence alone in its pass), so the load would change a seeded run's tokens.
        # Greedy tokens are the target's either way.
        lookup = self.lookup and spec.tree is None and not reproducible and spec.draft_length > 0
        return SequenceState(
            # Unique even when clients reuse request ids: two requests must never share a cache.
            sequence_id=f"{spec.request_id}:{uuid.uuid4().hex[:8]}",
            tokens=list(spec.prompt_ids),
            prompt_len=len(spec.prompt_ids),
            lengths=lengths,
            ahead=ahead,
            feature_log=FeatureLog() if self.features else None,
            started=started,
            lookup=lookup,
        )

    def _plan(self, spec: GenerationSpec, state: SequenceState) -> Turn:
        remaining = spec.max_new_tokens - state.generated
        policy_length, min_prob = state.lengths.plan()
        draft_length = 0 if state.lookup else min(policy_length, remaining - 1)  # with lookup the target drafts: nothing to ask
        if spec.max_context:
            draft_length = min(draft_length, spec.max_context - len(state.tokens) - 1)
        return Turn(remaining, policy_length, min_prob, draft_length)

    async def _draft(self, spec: GenerationSpec, state: SequenceState, stats: Stats, turn: Turn) -> None:
        """Takes the draft run ahead during the last Verify if there is one, else asks the draft
        (unless it failed lately), and cuts a calibrated proposal where its tokens stop paying."""
        ready, state.ready = state.ready, None  # drafted for this step only: a later one starts from another prefix
        if ready is not None and ready.tokens and turn.draft_length > 0:
            turn.draft, turn.from_ahead = _part(ready, 0, turn.draft_length), True
        elif self.proposer is not None and turn.draft_length > 0 and stats.steps >= state.skip_draft_until:
            await self._ask_draft(spec, state, stats, turn)
        draft = turn.draft
        cut = state.lengths.cut(draft.confidence)
        if cut is not None and cut < len(draft.tokens):
            turn.draft = dataclasses.replace(draft, tokens=draft.tokens[:cut], dists=draft.dists[:cut],
                                             confidence=draft.confidence[:cut])
        if turn.draft_wall is not None:
            state.lengths.asked(len(turn.draft.tokens))

    async def _ask_draft(self, spec: GenerationSpec, state: SequenceState, stats: Stats, turn: Turn) -> None:
        try:
            known = state.draft_known
            seed = derive_seed(spec.sampling.seed, len(state.tokens), "draft")
            features = state.feature_log.since(state.draft_features) if state.feature_log is not None else None
            if spec.tree is not None:
                call = ProposeCall(state.sequence_id, known, state.tokens[known:], turn.draft_length,
                                   temperature=spec.sampling.temperature, seed=seed, features=features, tree=self._tree(spec))
            else:
                call = ProposeCall(state.sequence_id, known, state.tokens[known:], turn.draft_length, turn.min_prob,
                                   spec.sampling.temperature, seed, features)
            draft = await self._propose(call, state.tokens, state.feature_log)
            state.draft_known = len(state.tokens)
            state.draft_features = state.features_held
            turn.draft, turn.draft_wall = draft, draft.wall_seconds
            if not draft.tokens and turn.min_prob > 0:
                state.lengths.nothing_drafted()
        except Exception as exc:  # noqa: BLE001 - a failing draft only costs speed
            stats.draft_failures += 1
            state.skip_draft_until = stats.steps + DRAFT_RETRY_STEPS
            state.forget_draft()
            log.warning("draft failed; decoding with the target alone for a while", error=str(exc))

    def _overlap(self, spec: GenerationSpec, state: SequenceState, stats: Stats, turn: Turn) -> None:
        """Puts the Verify's time to use: the draft drafts the next step meanwhile (run-ahead), or,
        when no step will draft (or the target drafts them itself, by prompt lookup), the target
        decodes the tokens after this one in the same exchange."""
        draft = turn.draft
        if draft.tokens and draft.parents is None and state.ahead.should_run_ahead():
            turn.runahead = self._run_ahead(state.sequence_id, state.tokens, draft, turn.policy_draft_length, turn.min_prob, spec)
        if state.lookup:
            turn.lookup = self._lookup(state)
        # Not before a stream's first token: its client waits on it, and would wait for the tokens
        # after it too. A request answered whole has no such client: its prompt's exchange goes on
        # decoding, so it costs one exchange, not two.
        first_waited = not stats.completion_tokens and not spec.answered_whole
        if not self.decode_ahead or turn.runahead is not None or first_waited or draft.parents is not None:
            return
        if turn.lookup[0]:
            turn.decode_ahead = self._ahead_budget(state, stats.steps, turn.remaining, spec, drafting=True)
        elif not draft.tokens:
            turn.decode_ahead = self._ahead_budget(state, stats.steps, turn.remaining, spec)

    async def _verify_draft(self, spec: GenerationSpec, state: SequenceState, turn: Turn) -> VerifyResult:
        try:
            verdict = await self._verify(state.sequence_id, state.tokens, state.target_known, turn.draft, spec, turn.decode_ahead,
                                         turn.lookup)
        except BaseException:
            if turn.runahead is not None:
                await turn.runahead.cancel()
            raise
        if len(verdict.decoded) > turn.decode_ahead:  # a target that decoded more than asked: keep what was asked
            verdict = dataclasses.replace(verdict, decoded=verdict.decoded[:turn.decode_ahead])
        return verdict

    def _commit(self, spec: GenerationSpec, state: SequenceState, stats: Stats, turn: Turn,
                verdict: VerifyResult) -> tuple[list[int], str | None]:
        """Records what the verdict leaves each service holding and what the step cost. Returns the
        step's new tokens and, if the request ends with them, why."""
        draft, accepted = turn.draft, verdict.accepted
        decoded = list(verdict.decoded)
        state.lengths.skip(verdict.passes - 1)
        appended = len(state.tokens) - state.target_known
        state.target_known = len(state.tokens) + accepted + len(decoded)
        if state.feature_log is not None and verdict.features is not None:
            state.put_features(verdict.features)
        if draft.parents is not None:
            # after a tree the draft holds the canonical tokens only: it gets the path next time
            new = [draft.tokens[i] for i in verdict.path] + [verdict.next_token] + decoded
        else:
            if draft.tokens:
                state.draft_known = len(state.tokens) + accepted  # the draft holds its accepted tokens already
            new = draft.tokens[:accepted] + [verdict.next_token] + decoded
        self._account(stats, state.lengths, draft, verdict, appended, asked=turn.draft_wall is not None)
        if turn.from_ahead:
            stats.runahead_used_tokens += accepted
        return _finish(new, spec.eos_token_ids, turn.remaining)

    async def _settle(self, state: SequenceState, stats: Stats, turn: Turn, verdict: VerifyResult, finish: str | None) -> None:
        """Keeps the run-ahead as the next step's draft if its bet won, else stops it; either way the
        run-ahead policy learns what the step cost."""
        draft, runahead = turn.draft, turn.runahead
        miss_wait = None
        if runahead is not None:
            # a request that ends here has no use for the next step's draft
            full_accept = verdict.accepted == len(draft.tokens) and finish is None
            state.ready, miss_wait = await runahead.settle(full_accept, verdict.next_token)
            stats.runahead_steps += 1
            stats.runahead_tokens += runahead.drafted
            if state.ready is not None:
                stats.runahead_hits += 1
                stats.runahead_used_tokens += 1  # the bonus guess was the target's token
        state.ahead.observe(len(draft.tokens), verdict.accepted, runahead is not None, state.ready is not None,
                            verdict.wall_seconds, turn.draft_wall, miss_wait)

    def _advance(self, state: SequenceState, stats: Stats, new: list[int], finish: str | None, verdict: VerifyResult) -> Step:
        state.tokens.extend(new)
        if state.ready is not None:
            state.draft_known = len(state.tokens)  # the draft holds the canonical tokens, then `ready`
        now = time.perf_counter()
        if stats.completion_tokens == 0:
            # A prompt's exchange that decoded ahead (a request answered whole) had its own pass's
            # tokens before the passes after it: the first token came when they would have arrived.
            stats.time_to_first_token_seconds = now - state.started - verdict.ahead_seconds
            stats.first_step_tokens = min(len(new), max(1, 1 + verdict.accepted + len(verdict.decoded) - verdict.ahead_tokens))
        stats.completion_tokens += len(new)
        stats.total_seconds = now - state.started
        return Step(new, finish, verdict.logprobs[:len(new)])

    def _ahead_budget(self, state: SequenceState, steps: int, remaining: int, spec: GenerationSpec, drafting: bool = False) -> int:
        """Tokens the target may decode after this step: the steps after it that will not draft
        (every one without a draft, the rest of a failed draft's wait, else the policy's quiet
        steps) within the burst (`_burst`), or with `drafting` (the target drafts them itself by
        lookup) all of them (the burst then bounds the passes: decode_ahead_passes), within the
        request's tokens and context."""
        limit = MAX_DECODE_AHEAD if drafting else self._burst(spec)
        if drafting or self.proposer is None:
            quiet = limit
        elif steps < state.skip_draft_until:
            quiet = state.skip_draft_until - steps - 1
        else:
            quiet = state.lengths.quiet_steps()
            quiet = limit if quiet is None else quiet
        budget = min(limit, quiet, remaining - 1)
        if spec.max_context:
            budget = min(budget, spec.max_context - len(state.tokens) - 2)
        return max(0, budget)

    def _burst(self, spec: GenerationSpec) -> int:
        """The most passes one exchange decodes ahead: --decode-ahead, the time between a stream's
        bursts of tokens; the contract's bound for a request answered whole, whose client sees no
        burst (the target still stops once another call waits, so no other request waits on it)."""
        return MAX_DECODE_AHEAD if spec.answered_whole else self.decode_ahead

    def _lookup(self, state: SequenceState) -> tuple[int, tuple[float, ...]]:
        """(most tokens, relative forward costs) for the target's lookup drafts: the request's draft
        length, and this loop's measured V(n) / V(1), by which the target cuts each draft as this
        loop cuts a calibrated proposal (best_prefix); none for a fixed draft length, drafted whole
        as the request asked. The costs are worked out again only when the cost model's fit changes.

        Not within the load cap that a draft service's proposals keep (plan()): where rows share a
        pass, the target cuts a lookup draft by what each position adds to that pass against the
        row's share of it (target_service/engine.py, PassCosts), which this loop cannot time. The
        cap left a full batch no draft at all, where a long match in a grounded answer still pays."""
        most = state.lengths.draft_length
        if not state.lengths.adaptive:
            return most, ()
        costs = self.cost_model.costs() if self.cost_model is not None else self.prior
        seen, length, relative = self._lookup_memo
        if seen is not costs or length != most:
            relative = relative_costs(costs, most)
            self._lookup_memo = (costs, most, relative)
        return most, relative

    def _run_ahead(self, sequence_id: str, tokens: list[int], draft: DraftOutcome, draft_length: int, min_prob: float,
                   spec: GenerationSpec) -> RunAhead | None:
        """Starts drafting the step after this one, assuming the target accepts all of `draft`.

        The draft still holds the chain it just proposed past the canonical tokens, so the call
        names that whole chain as known and sends nothing: its first token is the draft's guess at
        the target's bonus token, the rest the next step's draft (as long as this step's, within
        the request's remaining tokens and context).
        """
        after = len(tokens) + len(draft.tokens) + 1  # canonical length if the bet wins
        room = min(draft_length, spec.max_new_tokens - (after - len(spec.prompt_ids)) - 1)
        if spec.max_context:
            room = min(room, spec.max_context - after - 1)
        if room < 1:
            return None
        known = len(tokens) + len(draft.tokens)
        # Its own stream: when the bet is lost after a full accept, the next fresh draft starts at
        # this same position, and re-using the draws that decided the bet would bias its tokens.
        seed = derive_seed(spec.sampling.seed, after, "runahead")
        progress = Progress(asyncio.get_running_loop().create_future())
        call = ProposeCall(sequence_id, known, [], room + 1, min_prob, spec.sampling.temperature, seed)
        task = asyncio.get_running_loop().create_task(self.proposer.propose(call, progress=progress))
        return RunAhead(task, progress)

    async def _propose(self, call: ProposeCall, tokens: list[int], feature_log: FeatureLog | None = None) -> DraftOutcome:
        """Asks the draft for `call`; a draft that lost the sequence is sent the canonical `tokens`
        whole (with every feature, for a feature draft) and asked again."""
        try:
            return await self.proposer.propose(call)
        except SequenceNotFound:
            _refilled("draft", call.sequence_id)
            features = feature_log.since(0) if feature_log is not None else None
            return await self.proposer.propose(dataclasses.replace(call, known_len=0, append=list(tokens), features=features))

    def _tree(self, spec: GenerationSpec) -> TreeSettings:
        """The request's tree settings for this step. Under load a tree's nodes count against the
        verify token budget as a chain's tokens do (not for seeded requests: the load must not
        change their draws, as for chains)."""
        tree = spec.tree
        if not spec.seeded and self.cost_model is not None and self.cost_model.draft_cap is not None:
            tree = dataclasses.replace(tree, budget=max(1, min(tree.budget, self.cost_model.draft_cap())))
        return tree

    async def _verify(self, sequence_id, tokens, known, draft: DraftOutcome, spec: GenerationSpec,
                      decode_ahead: int = 0, lookup: tuple[int, tuple[float, ...]] = (0, ())) -> VerifyResult:
        try:
            return await self._verify_call(sequence_id, known, tokens[known:], draft, spec, decode_ahead, lookup)
        except SequenceNotFound:
            _refilled("target", sequence_id)
            return await self._verify_call(sequence_id, 0, list(tokens), draft, spec, decode_ahead, lookup)

    async def _verify_call(self, sequence_id, known, append, draft: DraftOutcome, spec: GenerationSpec,
                           decode_ahead: int = 0, lookup: tuple[int, tuple[float, ...]] = (0, ())) -> VerifyResult:
        if draft.parents is not None and draft.tokens:
            tree = DraftTree(draft.parents, draft.tokens, draft.dists)
            return await self.verifier.verify(VerifyCall(sequence_id, known, append, [], [], spec.sampling, tree,
                                                         return_features=self.features))
        return await self.verifier.verify(VerifyCall(
            sequence_id, known, append, draft.tokens, draft.dists if draft.parents is None else [], spec.sampling,
            return_features=self.features, decode_ahead=decode_ahead, logprobs=spec.logprobs,
            eos_banned_until=len(spec.prompt_ids) + spec.min_tokens if spec.min_tokens else 0,
            lookup_draft_length=lookup[0], lookup_costs=lookup[1], decode_ahead_passes=self._burst(spec) if lookup[0] else 0,
            # the call that creates the target's sequence (or re-fills it) seeds its lookup
            lookup_source=spec.prediction_ids if self.lookup and not known else ()))
