"""Admission under load: a cap on running requests, a bounded queue, and draft length by load.

- At most `max_running` requests run at once (each holds a sequence in the draft and the target
  and a row in the target's batch); up to `max_queue` more wait, first come first served. Past
  both, a request is refused at once with RESOURCE_EXHAUSTED and a retry hint, so memory stays
  bounded however much load is offered and a client learns promptly that it should back off.
- Speculation spends target compute on positions that may be thrown away: the target's pass costs
  little more for a few extra positions (on CPUs a forward over 16 new tokens costs about twice
  one: docs/benchmarks.md), but once the batch's rows already fill those positions, every draft token adds its full
  cost. So the running requests share a budget of verified positions per target pass: each may
  draft at most budget // running - 1 tokens (the -1 is its own next token). With a budget of 8:
  one request drafts up to 7, 2 up to 3, 4 up to 1, 8 or more none at all. 8 is the knee measured
  on a 2-core CPU: 8 streams through the three services made more tokens per second with budget 8
  than with 16 (one draft token each), on chat prompts and on long grounded ones alike, although
  the n-gram drafts were accepted half the time there. A GPU's knee is far higher, and a compact
  CPU kernel's lower. So by default (-2) the budget is the target's knee (ModelInfo.verify_knee):
  the most positions a pass verifies before it costs 1.5 times one position (specdec/maths/costs.py:
  knee), timed by the target at its start-up on its own device, where nothing else runs yet. -1
  reads the same rule off the coordinator's own per-request V(n) instead, which is noisy on a busy
  machine (a clean-clone run read a knee of 2 off a tiny model's). The draft-length policy
  (specdec/maths/draft_length.py) still chooses within that cap by acceptance and cost.
- Prompts the target feeds over several passes (longer than its prefill chunk) are bounded as
  vLLM bounds partial prefills: at most `max_partial_prefills` are admitted and not yet at their
  first token, and at most `max_long_partial_prefills` of those longer than
  `long_prefill_tokens`. A prompt over its bound waits without taking a running slot, and requests
  behind it that are within theirs pass it, while the long ones keep their order among themselves.
  Why: a flood of 50 prompts of 2,000 tokens took all 32 running slots and was prefilled all at
  once, so none of them finished for a long while, and ten short streams, whose first token comes
  almost at once, waited in the queue for all of it. One long prompt at a time is prefilled as fast
  as many interleaved (the target feeds one chunk a pass either way), finishes first, and leaves the
  other slots to the short requests (benchmarks/results/prefill-flood/NOTES.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable

from specdec.errors import Overloaded

MIN_RETRY_S, MAX_RETRY_S = 0.05, 60.0


def client_key(host: str, client_id: str = "") -> str:
    """Whom a request counts against for --max-streams-per-client, over gRPC and HTTP alike: the id
    the operator's gateway sent in --client-id-header when there is one, else the caller's IP
    address. Not the bearer token: with --api-token every client sends the same one, so all shared
    one cap, and without it any made-up Authorization value was a fresh client."""
    return f"id:{client_id}" if client_id else f"peer:{host}"


def grpc_peer_host(peer: str) -> str:
    """The address of a gRPC peer without its port: 'ipv4:10.0.0.7:54321' -> '10.0.0.7',
    'ipv6:[::1]:54321' -> '::1'; anything else ('unix:/run/s.sock') as it is. One client opens a
    connection (so a port) per channel: counting ports would count its channels, not the client."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rsplit(":", 1)[0]
    if kind == "ipv6":
        return address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]")
    return peer


def busy(message: str, retry_after_s: float) -> Overloaded:
    """RESOURCE_EXHAUSTED with how long the client should wait before trying again.

    An Overloaded itself, not a subclass, so every mapping of Overloaded (HTTP 429 included) holds.
    """
    exc = Overloaded(message)
    exc.retry_after_s = retry_after_s
    return exc


@dataclasses.dataclass
class Admitted:
    """A request's hold on the coordinator: its running slot, and a partial-prefill place until
    `prefilled` (its first token) or its end."""

    admission: "Admission"
    partial: bool = False
    long: bool = False

    def prefilled(self) -> None:
        """The prompt is in the target's cache: its place among the partial prefills goes to the next."""
        if self.partial:
            self.admission._prefill_done(self)


class Admission:
    """Not thread-safe: used from the coordinator's event loop only."""

    def __init__(self, max_running: int, max_queue: int, verify_token_budget: int = 8,
                 on_queue: Callable[[int], None] | None = None, on_admit: Callable[[float], None] | None = None,
                 max_partial_prefills: int = 0, max_long_partial_prefills: int = 0, long_prefill_tokens: int = 0,
                 prefill_chunk_tokens: int = 0):
        """`on_queue(depth)` hears every change of the queue's length (the queue-depth gauge);
        `on_admit(seconds)` how long each admitted request waited for its slot (the queue-time histogram).
        A prompt longer than `prefill_chunk_tokens` (the target's chunk; 0: none is chunked) is a partial
        prefill, and a long one past `long_prefill_tokens` too; 0 bounds: no bound."""
        if min(max_running, max_queue, max_partial_prefills, max_long_partial_prefills, long_prefill_tokens,
               prefill_chunk_tokens) < 0 or verify_token_budget < -2:
            raise ValueError("max_running, max_queue and the prefill bounds must be >= 0, verify_token_budget >= -2")
        self.max_running, self.max_queue, self.budget = max_running, max_queue, verify_token_budget
        self.max_partial, self.max_long = max_partial_prefills, max_long_partial_prefills
        self.long_prefill_tokens, self.prefill_chunk_tokens = long_prefill_tokens, prefill_chunk_tokens
        # verify_token_budget -1 / -2: the budget is sized by this callable once the coordinator has
        # its backends (the knee of its measured costs / of the target's start-up timing); 8 before.
        self.measured_budget: Callable[[], int] | None = None
        self.running = 0
        self.partial = self.long = 0  # admitted partial (long) prefills not yet at their first token
        self._waiting: collections.deque[tuple[asyncio.Future, Admitted]] = collections.deque()
        self._mean_seconds = 5.0  # decayed mean request duration, for the retry hint
        self._on_queue = on_queue
        self._on_admit = on_admit

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def _classify(self, prompt_tokens: int) -> Admitted:
        partial = bool(self.prefill_chunk_tokens) and prompt_tokens > self.prefill_chunk_tokens
        return Admitted(self, partial, partial and bool(self.long_prefill_tokens) and prompt_tokens > self.long_prefill_tokens)

    def _fits(self, admitted: Admitted) -> bool:
        """Whether a request may start now: a running slot is free, and a partial-prefill place if it needs one."""
        if self.max_running and self.running >= self.max_running:
            return False
        if admitted.partial and self.max_partial and self.partial >= self.max_partial:
            return False
        return not (admitted.long and self.max_long and self.long >= self.max_long)

    def _take(self, admitted: Admitted) -> None:
        self.running += 1
        self.partial += admitted.partial
        self.long += admitted.long

    @contextlib.asynccontextmanager
    async def slot(self, prompt_tokens: int = 0):
        """Holds a running slot for the body, yielding its Admitted; waits in the queue for one, or
        raises Overloaded (see `busy`)."""
        arrived = time.monotonic()
        admitted = self._classify(prompt_tokens)
        # Every change that frees room starts the waiters that fit (_hand_over), so one that fits now
        # is ahead of none that would: a short prompt behind long ones waiting for their turn starts.
        if self._fits(admitted):
            self._take(admitted)
        elif len(self._waiting) < self.max_queue:
            await self._wait_turn(admitted)
        else:
            raise busy(
                f"the coordinator is at capacity ({self.running} requests running, {len(self._waiting)} queued; "
                f"max_concurrent_requests={self.max_running}, max_queue={self.max_queue}); retry later",
                self.retry_after_s(),
            )
        start = time.monotonic()
        if self._on_admit is not None:
            self._on_admit(start - arrived)
        try:
            yield admitted
        finally:
            self._mean_seconds = 0.9 * self._mean_seconds + 0.1 * (time.monotonic() - start)
            self._leave(admitted)

    async def _wait_turn(self, admitted: Admitted) -> None:
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append((turn, admitted))
        self._queue_changed()
        try:
            await turn  # started by _hand_over, which took its slot for it
        except asyncio.CancelledError:  # the client gave up (deadline, cancel) while queued
            if turn.done() and not turn.cancelled():
                self._leave(admitted)  # the slot came just as we left: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove((turn, admitted))
                self._queue_changed()
            raise

    def _prefill_done(self, admitted: Admitted) -> None:
        self.partial -= admitted.partial
        self.long -= admitted.long
        admitted.partial = admitted.long = False
        self._hand_over()

    def _leave(self, admitted: Admitted) -> None:
        self.running -= 1
        self._prefill_done(admitted)  # a request ended before its first token gives its place back too

    def _hand_over(self) -> None:
        """Starts the waiters that fit now, oldest first."""
        for entry in list(self._waiting):
            turn, admitted = entry
            if turn.done():  # cancelled: its own handler removes it
                continue
            if self._fits(admitted):
                self._waiting.remove(entry)
                self._take(admitted)
                turn.set_result(None)
                self._queue_changed()
            elif self.max_running and self.running >= self.max_running:
                return

    def _queue_changed(self) -> None:
        if self._on_queue is not None:
            self._on_queue(len(self._waiting))

    def retry_after_s(self) -> float:
        """Roughly when a slot frees up for one more: the queue ahead drains at running / mean duration."""
        per_slot = self._mean_seconds / max(1, self.max_running or self.running)
        return min(MAX_RETRY_S, max(MIN_RETRY_S, per_slot * (len(self._waiting) + 1)))

    def draft_cap(self) -> int:
        """Most draft tokens a request may verify per step now (module docstring); large when unlimited."""
        budget = self.budget if self.budget >= 0 else (self.measured_budget() if self.measured_budget else 8)
        if not budget:
            return 1 << 16
        return max(0, budget // max(1, self.running) - 1)
