"""Decoding runs: the target's own loop for sequences whose drafts need no draft service.

A request decoded with prompt lookup (the n-gram drafter, a predicted output) or with no draft at all
needs nothing between two passes but the target itself: the lookup draft is cut from the
sequence's own tokens, which the target holds. Driven from the coordinator, each pass still cost a
Verify exchange (or one per `--decode-ahead` passes, and the stream's tokens then came in bursts).
A run is that loop inside the target: the coordinator starts it once on its Decode stream (one stream
per coordinator, every run multiplexed on it) and reads its tokens as the passes make them.

Each run is a task that submits its sequence's calls to the same VerifyBatcher as every Verify, so
runs share passes with each other and with the coordinators' step calls, and a run's tokens are
exactly the ones those Verify calls would make (the same `_verdict`, keyed by position). A call asks
to decode ahead for the whole rest of the run: where the batcher lets it (no other call waiting),
passes follow one another on the worker with no hop in between; the engine hands each pass's tokens
to `on_tokens` and they go out at once, so nothing waits for a burst to fill. A call that waits
interrupts the decoding ahead; the run then re-submits, and joins the next pass like any call.

What a stream sends is batched: every run's tokens since the last message go in one DecodeResponse,
written once per turn of the event loop. When the stream ends (the coordinator went away or closed
it), its runs stop and their sequences are released at once, not after the idle timeout.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import grpc
import structlog

from protos import specdec_pb2 as pb
from specdec.errors import SequenceNotFound, SpecdecError, Unavailable
from specdec.limits import MAX_DECODE_AHEAD, MAX_STREAM_INTERVAL
from specdec.model.features import FeatureLog, FeatureRows
from specdec.serving import metrics
from specdec.serving.wire import decode_run_call_from_proto, dists_from_proto, logprobs_to_proto
from specdec.maths.costs import MODEL_DRAFT_PRIOR, CostModel
from specdec.maths.draft_length import AcceptanceMemory, DraftLengthPolicy
from specdec.calls.request import ProposeCall, VerifyCall, VerifyResult
from specdec.maths.sampling import TokenLogprob, derive_seed
from target_service.drafts import DraftLink

# After the draft fails, a drafted run decodes this many passes alone before asking it again (as
# the coordinator's loop does: coordinator/loop.py DRAFT_RETRY_STEPS).
DRAFT_RETRY_STEPS = 16
# A proposal's timeout: the coordinator's default --rpc-timeout-s.
PROPOSE_TIMEOUT_S = 30.0

log = structlog.get_logger(__name__)


@dataclasses.dataclass
class Run:
    """One sequence decoded by the target until it ends; what it made waits in `out` for the next message."""

    sequence_id: str
    template: VerifyCall  # sampling, logprobs, banned end-of-sequence positions, lookup settings
    max_new: int
    stops: frozenset[int]
    length: int  # canonical tokens (the prompt and what the run made)
    append: list[int]  # what the next call brings: the prompt, then the last token made
    lookup_source: tuple[int, ...] = ()  # sent with the first call only: it seeds the sequence's lookup index
    made: int = 0
    in_call: int = 0  # tokens of the call in flight taken so far (from on_tokens); -1: no call in flight
    done: bool = False
    cancelled: bool = False
    ending: bool = False  # in its task's `finally`: releasing, nothing to cancel
    out: pb.DecodeProgress | None = None
    task: asyncio.Task | None = None
    stream: _Stream | None = None
    drafted: Drafted | None = None  # drafting with the target's draft service
    ask: tuple[float, float] = (0.0, 0.0)  # the last proposal's (draft compute, wire) seconds
    report_every: int = 1  # tokens its progress holds before it is sent (DecodeRun.report_every)
    reported: int = 0  # tokens sent so far

    def next_call(self, ahead: int | None = None) -> VerifyCall:
        """A step at the run's end: it decodes ahead for every token the run may still make (or `ahead`)."""
        ahead = min(self.max_new - self.made - 1, MAX_DECODE_AHEAD, MAX_DECODE_AHEAD if ahead is None else ahead)
        call = dataclasses.replace(self.template, known_len=self.length - len(self.append), append=self.append,
                                   decode_ahead=ahead, decode_ahead_passes=ahead if ahead > 0 else 0,
                                   lookup_source=self.lookup_source)
        self.lookup_source = ()
        return call

    def due(self) -> bool:
        """Whether its progress goes out with the stream's next message: after every pass, or once
        it holds report_every tokens, its first token (not what a burst may cost) or its end."""
        out = self.out
        if out is None or self.report_every <= 1 or self.ending:
            return out is not None
        return len(out.tokens) >= self.report_every or (self.reported == 0 and len(out.tokens) > 0)

    def progress(self) -> pb.DecodeProgress:
        if self.out is None:
            self.out = pb.DecodeProgress(sequence_id=self.sequence_id)
        return self.out

    def take(self, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        """Makes `tokens` canonical, up to the run's end (a stop token, max_new)."""
        out = self.progress()
        for i, token in enumerate(tokens):
            if self.done:
                break
            out.tokens.append(token)
            if i < len(logprobs):
                out.logprobs.extend(logprobs_to_proto([logprobs[i]]))
            self.made += 1
            self.length += 1
            self.append = [token]
            if self.drafted is not None:
                self.drafted.tokens.append(token)
            self.done = token in self.stops or self.made >= self.max_new


@dataclasses.dataclass
class Drafted:
    """A run's drafting with the target's draft service: the canonical tokens (what the draft is
    sent), how many the draft holds, and the draft-length policy the coordinator's loop would run."""

    tokens: list[int]
    policy: DraftLengthPolicy
    seeded: bool
    known: int = 0  # leading canonical tokens the draft holds
    log: FeatureLog | None = None  # a feature draft's: the target's hidden states of the canonical positions
    features_known: int = 0  # leading features the draft holds
    overlap: bool = False  # the draft drafts the next step while the target verifies this one
    plan: tuple[int, float] = (0, 0.0)  # this step's (the policy's draft length, min cumulative probability)
    ready: tuple[list[int], list] | None = None  # the next step's draft, drafted ahead: (tokens, dists)
    hits: int = 0  # steps whose draft was drafted ahead (counted for the tests and the log)
    steps: int = 0  # target passes so far
    skip_until: int = 0  # after a draft failure, the pass at which the draft is asked again


class DecodeStreams:
    """Every Decode stream of one target and their runs. `submit(call)` is the VerifyBatcher's;
    `release(sequence_id)` frees a sequence on the worker; `draining()` says the server stops."""

    def __init__(self, submit, release, draining=lambda: False, link: DraftLink | None = None):
        """`link`: the target's stream to its draft service (`--draft`), for runs with draft_length."""
        self._submit, self._release, self.draining, self.link = submit, release, draining, link
        # Step costs seen by every drafted run (the machines', not a request's), as the coordinator's CostModel
        self.cost_model = CostModel(MODEL_DRAFT_PRIOR)
        self.acceptance = AcceptanceMemory()  # ... and the acceptance they saw, where a new run starts
        self.hits = 0  # steps of pipelined runs whose draft was drafted during the pass before
        self.runs: dict[str, Run] = {}  # every stream's runs, by sequence (the engine's reports name sequences)
        # Runs that ended (cancelled, or a stop token) while a call of theirs may be on the worker:
        # the passes it decodes ahead for them are waste, so their rows stop (`dropped`).
        self.stopping: set[str] = set()
        self._streams: set[_Stream] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reports: collections.deque = collections.deque()  # the engine's, not yet taken by the loop
        self._woken = False

    def dropped(self, sequence_id: str) -> bool:
        """Whether the passes decoded ahead should stop for this sequence (its run ended or was
        cancelled): its row leaves, the others go on. Safe on the worker (a set's membership)."""
        return sequence_id in self.stopping

    def drain(self) -> None:
        """The server is shutting down: runs in flight finish, streams end once they have none."""
        for stream in self._streams:
            stream.changed()

    def _stop(self, run: Run) -> None:
        if run.cancelled or run.ending:  # once: a second cancel would cut the release in its `finally`
            return
        run.cancelled = True
        self.stopping.add(run.sequence_id)
        if run.task is not None:
            run.task.cancel()

    def on_tokens(self, reports) -> None:
        """The engine's per-pass report, on the worker thread: handed to the event loop, with one
        wake-up for all the reports made before the loop takes them (a wake-up costs the loop's
        thread a turn, which on a small CPU the worker's next pass pays for)."""
        if self._loop is None or not any(sequence_id in self.runs for sequence_id, *_ in reports):
            return
        self._reports.append(reports)  # a deque: appends and pops are thread-safe
        if not self._woken:
            self._woken = True
            self._loop.call_soon_threadsafe(self._take_reports)

    def _take_reports(self) -> None:
        self._woken = False  # before taking: a report appended after this wakes the loop again
        while self._reports:
            self._arrived(self._reports.popleft())

    def _arrived(self, reports) -> None:
        for sequence_id, index, tokens, logprobs in reports:
            run = self.runs.get(sequence_id)
            if run is None or run.in_call < 0 or index + len(tokens) <= run.in_call:
                continue
            skip = run.in_call - index  # reported already (a report repeats nothing, but be sure)
            run.take(tokens[skip:], logprobs[skip:])
            run.in_call = index + len(tokens)
            if run.done:
                self.stopping.add(sequence_id)
            run.stream.changed()

    async def serve(self, requests, context):
        """The Decode method: reads starts and cancels, yields one DecodeResponse per batch of news."""
        self._loop = asyncio.get_running_loop()
        stream = _Stream()
        self._streams.add(stream)
        reader = self._loop.create_task(self._read(requests, stream))
        try:
            while True:
                message = stream.collect()
                if message.runs:
                    yield message  # runs may end meanwhile: collect again before deciding the stream is done
                    continue
                if reader.done() and reader.exception() is not None:
                    raise reader.exception()
                if (reader.done() or self.draining()) and not stream.runs:
                    return  # the coordinator closed its side, or the server drains, and every run has ended and been sent
                await stream.wake.wait()
                stream.wake.clear()
        finally:
            self._streams.discard(stream)
            reader.cancel()
            runs = list(stream.runs.values())
            for run in runs:  # the coordinator went away: stop its runs, free their caches
                self._stop(run)
            await asyncio.gather(*(run.task for run in runs if run.task is not None), return_exceptions=True)

    async def _read(self, requests, stream: _Stream) -> None:
        try:
            async for request in requests:
                for sequence_id in request.cancel:
                    run = stream.runs.get(sequence_id)
                    if run is not None:
                        self._stop(run)
                for started in request.start:
                    self._start(started, stream)
        finally:
            stream.changed()  # the loop above sees the end

    def _start(self, message: pb.DecodeRun, stream: _Stream) -> None:
        sequence_id = message.sequence_id
        if sequence_id in self.runs:
            stream.fail(sequence_id, grpc.StatusCode.ALREADY_EXISTS, f"sequence {sequence_id!r} already has a run")
            return
        if self.draining():
            stream.fail(sequence_id, grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
            return
        if not 0 <= message.report_every <= MAX_STREAM_INTERVAL:
            return stream.fail(sequence_id, grpc.StatusCode.INVALID_ARGUMENT, f"report_every: not in [0, {MAX_STREAM_INTERVAL}]")
        if message.max_new_tokens < 1:
            stream.fail(sequence_id, grpc.StatusCode.INVALID_ARGUMENT, f"max_new_tokens must be >= 1, got {message.max_new_tokens}")
            return
        if message.draft_length and (self.link is None or not 0 < message.draft_length <= MAX_DECODE_AHEAD):
            why = "this target has no draft service (--draft)" if self.link is None else "out of range"
            stream.fail(sequence_id, grpc.StatusCode.INVALID_ARGUMENT, f"draft_length: {why}")
            return
        if message.draft_length and message.known_len:  # the draft is sent the canonical tokens: all of them
            stream.fail(sequence_id, grpc.StatusCode.INVALID_ARGUMENT, "known_len: a drafted run starts from the whole sequence (0)")
            return
        template = decode_run_call_from_proto(message)
        run = Run(sequence_id, template, message.max_new_tokens, frozenset(message.stop_token_ids),
                  length=message.known_len + len(message.append_tokens), append=list(message.append_tokens),
                  lookup_source=tuple(message.lookup_source), in_call=-1, report_every=message.report_every)
        run.stream = stream
        if message.draft_length:
            policy = DraftLengthPolicy(draft_length=message.draft_length, cost_model=None if message.seeded else self.cost_model,
                                       prior=MODEL_DRAFT_PRIOR, adaptive=message.adaptive,
                                       memory=None if message.seeded else self.acceptance)
            run.drafted = Drafted(list(message.append_tokens), policy, message.seeded,
                                  log=FeatureLog() if message.features else None, overlap=message.overlap)
            if message.features:
                run.template = dataclasses.replace(template, return_features=True)
        self.runs[sequence_id] = stream.runs[sequence_id] = run
        run.task = asyncio.get_running_loop().create_task(self._drive(run, stream), name=f"run-{sequence_id}")
        run.task.add_done_callback(lambda _: self._never_started(run, stream))

    def _never_started(self, run: Run, stream: _Stream) -> None:
        """A run cancelled before its task began never reaches `_drive`'s `finally`: end it here."""
        if not run.ending:
            self._end(run, stream, grpc.StatusCode.CANCELLED, "the run was cancelled")
            self.stopping.discard(run.sequence_id)

    def _end(self, run: Run, stream: _Stream, code: grpc.StatusCode, message: str) -> None:
        """The run's last progress (done, with its error if any) goes out with the stream's next message."""
        run.ending = True
        self.runs.pop(run.sequence_id, None)
        stream.runs.pop(run.sequence_id, None)
        out = run.progress()
        out.done = True
        if code != grpc.StatusCode.OK:
            out.error_code, out.error_message = code.value[0], message
        stream.finished.append(run)
        stream.changed()

    async def _drive(self, run: Run, stream: _Stream) -> None:
        """The run's loop: a call at its end, the tokens the call made beyond those reported already."""
        code, message = grpc.StatusCode.OK, ""
        try:
            while not run.done:
                draft = await self._draft(run) if run.drafted is not None else None
                call = draft if draft is not None else run.next_call(self._quiet(run) if run.drafted is not None else None)
                ahead = self._run_ahead(run, call) if draft is not None and run.drafted.overlap else None
                run.in_call = 0
                try:
                    result = await self._submit(call)
                finally:
                    taken, run.in_call = run.in_call, -1
                self.stopping.discard(run.sequence_id)  # its call is back: nothing of it is on the worker
                made = [result.next_token, *result.decoded] if not result.accepted else \
                    [*call.draft_tokens[:result.accepted], result.next_token, *result.decoded]
                run.take(made[taken:], list(result.logprobs[taken:]))
                out = run.progress()
                out.passes += 1 + result.ahead_passes
                out.drafted += len(call.draft_tokens) + result.ahead_drafted
                out.accepted += result.accepted + result.ahead_accepted
                out.prediction_drafted += result.predicted_drafted
                out.prediction_accepted += result.predicted_accepted
                out.compute_seconds += result.compute_seconds
                self._observe(call, result)
                if run.drafted is not None:
                    self._drafted(run, call, result)
                if ahead is not None:
                    await self._settle(run, call, result, ahead)
                stream.changed()
        except SpecdecError as exc:
            code, message = exc.code, str(exc)
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.CANCELLED, "the run was cancelled"
        except Exception as exc:  # noqa: BLE001 - a bug fails its run, not the stream
            log.exception("decoding run failed", sequence_id=run.sequence_id)
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
        finally:
            # The end goes out before the release: the coordinator waits for it (it carries the
            # last call's costs), and the release waits for the worker.
            self._end(run, stream, code, message)
            if run.drafted is not None and self.link is not None:
                self.link.release(run.sequence_id)
            try:  # on the worker, behind any pass of a call cancelled mid-way
                await asyncio.shield(self._release(run.sequence_id))
            except Exception:  # noqa: BLE001 - the idle timeout frees it eventually
                log.warning("releasing a finished run failed", sequence_id=run.sequence_id)
            self.stopping.discard(run.sequence_id)


    async def _draft(self, run: Run) -> VerifyCall | None:
        """The next call of a drafted run: the draft service's proposal for the run's end, as the
        coordinator's loop would ask for it (planned by the same policy, the same seeds); None
        where this step drafts nothing (then the call decodes ahead through the quiet steps)."""
        d, remaining = run.drafted, run.max_new - run.made
        policy_length, min_prob = d.plan = d.policy.plan()
        draft_length = min(policy_length, remaining - 1)
        ready, d.ready = d.ready, None  # drafted for this step only
        if draft_length <= 0 or d.steps < d.skip_until:
            return None
        if ready is not None and ready[0]:  # drafted during the last pass: no wait for the draft
            d.hits += 1
            self.hits += 1
            run.ask = (0.0, 0.0)
            call = run.next_call(ahead=0)
            return dataclasses.replace(call, draft_tokens=ready[0][:draft_length], draft_dists=ready[1][:draft_length])
        sampling = run.template.sampling
        ask = ProposeCall(run.sequence_id, d.known, d.tokens[d.known:], draft_length, min_prob, sampling.temperature,
                          derive_seed(sampling.seed, run.length, "draft"), self._features(d, d.features_known))
        started = time.perf_counter()
        try:
            try:
                answer = await self.link.propose(ask, PROPOSE_TIMEOUT_S)
            except SequenceNotFound:  # the draft restarted or evicted it: re-send it whole
                ask = dataclasses.replace(ask, known_len=0, append=list(d.tokens), features=self._features(d, 0))
                answer = await self.link.propose(ask, PROPOSE_TIMEOUT_S)
        except (Unavailable, SequenceNotFound) as exc:  # a failing draft only costs speed
            d.skip_until, d.known, d.features_known = d.steps + DRAFT_RETRY_STEPS, 0, 0
            log.warning("draft failed; decoding with the target alone for a while", sequence_id=run.sequence_id, error=str(exc))
            return None
        d.known = len(d.tokens)
        if d.log is not None:
            d.features_known = len(d.log)
        tokens = [m.token_id for m in answer.tokens]
        d.policy.asked(len(tokens))
        if not tokens:
            if min_prob > 0:
                d.policy.nothing_drafted()
            return None
        run.ask = (answer.compute_seconds, max(0.0, time.perf_counter() - started - answer.compute_seconds))
        dists = dists_from_proto(m.dist for m in answer.tokens)
        call = run.next_call(ahead=0)
        return dataclasses.replace(call, draft_tokens=tokens, draft_dists=dists)

    @staticmethod
    def _observe(call: VerifyCall, result: VerifyResult) -> None:
        """The target's metrics, as a Verify call's are observed (target_service/servicer.py)."""
        m = metrics.target()
        m.verify_seconds.observe(result.compute_seconds)
        m.batch_size.observe(result.batch_size)
        m.draft_tokens.inc(len(call.draft_tokens) + result.ahead_drafted)
        m.accepted_tokens.inc(result.accepted + result.ahead_accepted)

    def _run_ahead(self, run: Run, call: VerifyCall) -> asyncio.Task | None:
        """Pipelining: while the target verifies `call`, the draft drafts the step after it, on the bet
        that the target accepts the whole draft. The draft still holds the chain past the canonical
        tokens, so the ask names it all as known and sends nothing; its first token is the draft's
        guess at the target's own next token, the rest the next step's draft (its own seed: the
        bet's draws must not be the ones a fresh ask at that position would make). Lossless: these
        are proposals like any other, used only after the very prefix they were drafted from."""
        d = run.drafted
        policy_length, min_prob = d.plan
        after = call.known_len + len(call.append) + len(call.draft_tokens) + 1  # canonical length if the bet wins
        room = min(policy_length, run.max_new - (run.made + len(call.draft_tokens) + 1) - 1)
        if room < 1:
            return None
        sampling = run.template.sampling
        ask = ProposeCall(run.sequence_id, after - 1, [], room + 1, min_prob, sampling.temperature,
                          derive_seed(sampling.seed, after, "runahead"))
        task = asyncio.get_running_loop().create_task(self.link.propose(ask, PROPOSE_TIMEOUT_S))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a lost bet's failure is nobody's
        return task

    @staticmethod
    async def _settle(run: Run, call: VerifyCall, result: VerifyResult, ahead: asyncio.Task) -> None:
        """After the verdict: the drafted-ahead tokens become the next step's draft if the target
        accepted the whole draft and its own token is the draft's guess; otherwise they are dropped
        (the next ask's known_len crops them from the draft's copy)."""
        d = run.drafted
        if run.done or result.accepted < len(call.draft_tokens) or result.decoded:
            return
        try:
            answer = await ahead
        except SpecdecError:
            return
        tokens = [m.token_id for m in answer.tokens]
        if len(tokens) < 2 or tokens[0] != result.next_token:
            return
        d.ready = (tokens[1:], dists_from_proto(m.dist for m in answer.tokens[1:]))
        d.known = run.length  # the guess was the target's token: the draft holds the canonical tokens, then `ready`

    @staticmethod
    def _quiet(run: Run) -> int | None:
        """Passes a drafted run's call may decode ahead after a step that drafts nothing: the steps
        the policy will not draft either (None: all), as the coordinator's loop asks (`_ahead_budget`),
        so the policy sees the same steps and a seeded run asks the draft at the same positions."""
        d = run.drafted
        if d.steps < d.skip_until:
            return d.skip_until - d.steps - 1
        return d.policy.quiet_steps()

    @staticmethod
    def _features(d: Drafted, start: int) -> FeatureRows | None:
        """The features from `start` on that a feature draft lacks (None: not a feature draft)."""
        return d.log.since(start) if d.log is not None else None

    def _drafted(self, run: Run, call: VerifyCall, result: VerifyResult) -> None:
        """What a drafted run's pass leaves the policy, the costs and the draft's copy knowing."""
        d, drafted = run.drafted, len(call.draft_tokens)
        if d.log is not None and result.features is not None:
            # as the coordinator's SequenceState.put_features: they replace any held from their start on
            if result.features.start <= len(d.log):
                d.log.put(result.features)
                d.features_known = min(d.features_known, result.features.start)
        passes = 1 + result.ahead_passes
        d.steps += passes
        if drafted:
            d.known = call.known_len + len(call.append) + result.accepted  # the draft holds its accepted tokens
            d.policy.observe(drafted, result.accepted)
            draft_compute, ask = run.ask
            if not d.seeded and len(call.append) <= 1:
                self.cost_model.observe(drafted, draft_compute, drafted + 1, result.compute_seconds, 0.0, ask)
        else:
            d.policy.skip(passes - 1)
            if not d.seeded and len(call.append) <= 1:
                self.cost_model.observe(0, 0.0, 1, result.compute_seconds / passes, 0.0)


class _Stream:
    """One Decode stream: its runs, and the news waiting for its next message."""

    def __init__(self):
        self.runs: dict[str, Run] = {}
        self.finished: list[Run] = []  # ended since the last message
        self.failed: list[pb.DecodeProgress] = []  # starts refused
        self.wake = asyncio.Event()

    def changed(self) -> None:
        self.wake.set()

    def fail(self, sequence_id: str, code: grpc.StatusCode, message: str) -> None:
        self.failed.append(pb.DecodeProgress(sequence_id=sequence_id, done=True, error_code=code.value[0], error_message=message))
        self.changed()

    def collect(self) -> pb.DecodeResponse:
        """Every run's news since the last message, in one message."""
        response = pb.DecodeResponse()
        response.runs.extend(self.failed)
        self.failed.clear()
        for run in [*self.runs.values(), *self.finished]:
            if run.due():
                response.runs.append(run.out)
                run.reported += len(run.out.tokens)
                run.out = None
        self.finished.clear()
        return response
