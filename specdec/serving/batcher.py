"""Continuous batching: the calls waiting when the model frees up run as ONE pass.

Both services batch this way: the target its Verify calls (target_service/batcher.py), the draft
the per-token forwards of the Propose streams drafting at the same time (draft_service/batcher.py).
Decoding is memory-bound: one call's forward is a matrix-vector product that leaves the hardware
idle, while stacked as rows of one pass the weights are read once for all of them.

Runs in the servicer's event loop (no gRPC here). One pass is in flight at a time, on the engine's
worker thread; calls that arrive meanwhile wait and form the next batch, so sequences join and
leave at any step. A batcher is given:

- `run(fn, *args)`: awaits fn on the engine's worker;
- `run_batch(calls, alone)`: the engine's pass, one result (or one error) per call, in order;
  `alone` says no other sequence is expected soon, so the engine may do more for this one (the
  target decodes ahead) without holding anybody's next call up;
- `key(call)`: the sequence a call belongs to. Rows of one pass are distinct sequences: two rows
  must not share a cache, so a second call for the same sequence (a late retry) waits a pass;
- `cost(call)`: the positions a call feeds. Rows are padded to the longest, so a pass costs rows x
  longest, which `max_batch_tokens` bounds; where `ragged()` says the engine pads nothing (each row
  feeds only its own positions), a pass costs the sum of its rows' instead;
- `seconds(result)`: what a result says its compute took (None: the pass's wall time), which sizes
  the window below;
- `inline(call)` (optional): whether a call run alone (below) may run on the event loop itself;
- `settles` (optional): run_batch takes `settle(index, result)` and may answer a row before the pass
  returns (the target's rows decoding ahead, each done when its budget is spent);
- `joinable(call)` (optional, with `settles`): whether a call that arrives while a pass runs may join
  that pass between two of its forwards; run_batch then takes `join` (a Joins) to take them.

Why calls join a running pass. Under many streams the target's rows decode ahead pass after pass,
and every new request's first call, or a row's next one, arrived while a pass ran: it stopped every
row's decoding ahead (`waiting`), the worker idled while the rows' callers came back through the
event loop and the window, and a new pass began. A call that may join waits one forward instead,
and the pass goes on (iteration-level batching, as in Orca and vLLM).

Why it waits. Before starting a pass it waits a short while for the calls it expects: one from
every sequence active lately (a call within the last few passes' time, and not released since)
that has no call pending yet. After a pass returns, its callers each do their own work (ask the
draft, send a token) and come back apart; a pass started on the first arrival would split them into
two half batches, and a batcher that only waited for as many calls as its last pass had would let
the halves alternate for good. The wait ends when every expected sequence has a call pending, or
after `window_s` or a share of the last pass's compute, whichever is longer: a row that misses the
pass waits a whole pass instead.

Why a lone call runs directly. A call from the only active sequence, seen before, with the model
free, runs straight from its own task: no batch can form, and the two hops to the batcher's task
and back are a noticeable part of a short exchange. (A new sequence goes through the window:
others may be arriving with it, as when many streams start.) Where `inline(call)` says so, it does
not even hop to the worker thread and back: the pass runs right on the event loop, which then
serves nothing else until it returns. The caller says when that is fair: a step's call, not a
prompt, with the worker idle and computing no faster than this thread would.

A row may come back as `Requeue(call)`: it made progress but is not done (a long prompt fed one chunk
per pass, chunked prefill). It goes to the back of the queue as `call`, so the rows waiting meanwhile
(other sequences' decode steps) run before its next chunk: one long prompt delays them by at most
one chunk's pass.

A failed pass fails its rows, never the batcher; a call cancelled while it waits is skipped.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

C = TypeVar("C")  # a call: one row of a pass
R = TypeVar("R")  # its result

# A sequence that stops calling without a release (its client vanished) stops being waited for after
# this many passes' time, and never sooner than RECENT_FLOOR_S.
RECENT_PASSES = 4
RECENT_FLOOR_S = 1.0


@dataclasses.dataclass(frozen=True)
class Requeue(Generic[C]):
    """A pass's answer for a row that is not finished: run `call` in a later pass."""

    call: C


@dataclasses.dataclass
class _Pending(Generic[C]):
    call: C
    future: asyncio.Future


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():  # cancelled while the pass ran
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class ContinuousBatcher(Generic[C, R]):
    """The batching loop; subclasses may say differently which calls a pass expects (`_gathered`)
    and which run directly (`_arrive`)."""

    name = "batcher"
    window_share = 0.25  # the wait may stretch to this share of the last pass's compute

    def __init__(
        self,
        run: Callable[..., Awaitable[Any]],
        run_batch: Callable[[list[C], bool], Sequence[R | BaseException]],
        *,
        key: Callable[[C], Hashable],
        cost: Callable[[C], int],
        window_s: float = 0.002,
        max_batch_size: int = 16,
        max_batch_tokens: int = 256,
        seconds: Callable[[R], float] | None = None,
        inline: Callable[[C], bool] | None = None,
        ragged: Callable[[], bool] | None = None,
        settles: bool = False,
        joinable: Callable[[C], bool] | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._run, self._run_batch, self._key, self._cost, self._seconds = run, run_batch, key, cost, seconds
        self._inline, self._ragged = inline, ragged
        # run_batch takes a keyword `settle(index, result)`, called on the worker for a row that is done
        # before the pass returns (the target's rows decoding ahead leave one by one)
        self._settles = settles
        self._joinable = joinable if settles else None
        self._joiners: collections.deque[_Pending[C]] = collections.deque()  # calls offered to the running pass
        self._joins_open = False  # a pass that takes joiners runs (not a call run alone)
        self.window_s, self.max_batch_size, self.max_batch_tokens = window_s, max_batch_size, max_batch_tokens
        self._pending: list[_Pending[C]] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._active: dict[Hashable, float] = {}  # sequence -> time of its last call (monotonic)
        self._prefilling: set[Hashable] = set()  # sequences whose last pass fed a chunk (Requeue)
        self._last_compute_s = 0.0
        self._running = False  # a pass is on the worker (from the loop, or a call run directly)
        self.batches = 0  # passes run, and the rows they carried (tests and metrics read these)
        self.rows = 0

    async def submit(self, call: C) -> R:
        """Queues the call for the next pass and returns its own result (or raises its own error)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)
        if self._arrive(call):
            return await self._run_alone(call)
        item = _Pending(call, asyncio.get_running_loop().create_future())
        if self._joins_open and self._joinable(call):
            self._joiners.append(item)  # the running pass takes it (Joins), or it waits for the next one
        else:
            self._pending.append(item)
            self._arrived.set()
        return await item.future  # cancelled while waiting: the pass skips it

    def waiting(self) -> bool:
        """Whether a call waits for the next pass: a pass that does extra work for its own rows
        (the target decoding ahead) stops then; a pass that takes joiners takes them first. Safe
        to call from the worker thread."""
        return bool(self._pending) or bool(self._joiners)

    def released(self, key: Hashable) -> None:
        """A sequence left: do not wait for its next call."""
        self._active.pop(key, None)
        self._prefilling.discard(key)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # --- which calls a pass expects ---

    def _arrive(self, call: C) -> bool:
        """Marks the call's sequence active; True: it is the only active one, seen before, and the
        model is free, so the call runs from its own task."""
        key = self._key(call)
        alone = not self._running and not self._pending and key in self._active and self._expected() <= {key}
        self._active[key] = time.monotonic()
        return alone

    def _expected(self) -> set[Hashable]:
        """The sequences the next pass should hold: those that called lately."""
        horizon = time.monotonic() - max(RECENT_FLOOR_S, RECENT_PASSES * self._last_compute_s)
        for key in [k for k, seen in self._active.items() if seen < horizon]:
            del self._active[key]
            self._prefilling.discard(key)  # a prompt abandoned mid-way is not kept for good
        return set(self._active)

    def _gathered(self) -> bool:
        """Whether every expected sequence (up to max_batch_size of them) has a call waiting."""
        expected = self._expected()
        waiting = {self._key(item.call) for item in self._live()}
        return len(waiting & expected) >= min(self.max_batch_size, max(1, len(expected)))

    # --- the passes ---

    async def _run_alone(self, call: C) -> R:
        """The only active sequence's call, with the model free: there is no batch to form, so it
        runs from the caller's task, without the hops to the batcher's task and back (and on the
        event loop itself where `inline` allows it)."""
        self._running = True
        started = time.perf_counter()
        try:
            if self._inline is not None and self._inline(call):
                results = self._run_batch([call], True)
            else:
                results = await self._run(self._run_batch, [call], True)
        finally:
            self._running = False
            if self._pending:  # calls that arrived meanwhile: the loop takes them now
                self._arrived.set()
        self._count(results, time.perf_counter() - started)
        self._note_prefills([call], results)
        if isinstance(results[0], Requeue):  # a prompt fed in chunks: its next chunk in the next pass
            return await self.submit(results[0].call)
        if isinstance(results[0], BaseException):
            raise results[0]
        return results[0]

    async def _loop(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            if self._running or not self._live():  # a call run alone sets _arrived when it is done
                continue
            await self._gather_window()
            if self._running:  # a call ran alone while every waiting one was cancelled
                continue
            batch = self._take()
            if batch:
                await self._pass(batch)
            if self._pending:
                self._arrived.set()

    async def _pass(self, batch: list[_Pending[C]]) -> None:
        # Extra work for this pass's rows (a long chunk, decoding ahead) would hold up the next calls
        # of the other active sequences: only when there are none, long prompts still being fed
        # aside (they have no tokens to wait for). The engine checks the sequences it holds itself.
        alone = not (self._expected() - self._prefilling - {self._key(item.call) for item in batch})
        self._running = True
        started = time.perf_counter()
        run_batch = self._run_batch
        if self._settles:
            loop = asyncio.get_running_loop()
            run_batch = functools.partial(
                run_batch, settle=lambda index, result: loop.call_soon_threadsafe(_settle, batch[index].future, result))
            if self._joinable is not None:
                run_batch = functools.partial(run_batch, join=Joins(self, loop))
                self._joins_open = True
        try:
            results = await self._run(run_batch, [item.call for item in batch], alone)
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its rows, never the batcher
            results = [exc] * len(batch)
        finally:
            self._running = self._joins_open = False
            while self._joiners:  # offered after the pass's last forward: the next pass's
                self._pending.append(self._joiners.popleft())
        self._count(results, time.perf_counter() - started)
        self._note_prefills([item.call for item in batch], results)
        for item, result in zip(batch, results):
            if isinstance(result, Requeue) and not item.future.done():
                self._pending.append(_Pending(result.call, item.future))  # behind the rows that waited
                continue
            _settle(item.future, result)

    def _answer_joiner(self, item: _Pending[C], result: Any) -> None:
        """A joiner's answer, on the loop: a Requeue (the pass could not take it) waits for the next pass."""
        if isinstance(result, Requeue):
            if not item.future.done():
                self._pending.append(_Pending(result.call, item.future))
                self._arrived.set()
            return
        _settle(item.future, result)

    def _note_prefills(self, calls: list[C], results: Sequence[R | BaseException]) -> None:
        for call, result in zip(calls, results):
            if isinstance(result, Requeue):
                self._prefilling.add(self._key(call))
            else:
                self._prefilling.discard(self._key(call))

    def _count(self, results: Sequence[R | BaseException], wall_s: float) -> None:
        self.batches += 1
        self.rows += len(results)
        if self._seconds is None:
            self._last_compute_s = wall_s
        else:
            self._last_compute_s = max((self._seconds(r) for r in results if not isinstance(r, (BaseException, Requeue))),
                                       default=wall_s)

    async def _gather_window(self) -> None:
        deadline = time.monotonic() + max(self.window_s, self._last_compute_s * self.window_share)
        while not self._gathered():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                return

    def _live(self) -> list[_Pending[C]]:
        self._pending = [item for item in self._pending if not item.future.done()]  # drop cancelled calls
        return self._pending

    def _take(self) -> list[_Pending[C]]:
        """Up to max_batch_size calls, oldest first, one per sequence. Past max_batch_tokens padded
        positions (or positions, `ragged`) a call waits for the next pass (the oldest always goes):
        one long prefill does not pad every short decode row to its length."""
        batch: list[_Pending[C]] = []
        seen: set[Hashable] = set()
        rest: list[_Pending[C]] = []
        longest = total = 0
        ragged = self._ragged is not None and self._ragged()
        for item in self._live():
            key, cost = self._key(item.call), self._cost(item.call)
            padded = total + cost if ragged else (len(batch) + 1) * max(longest, cost)
            fits = not batch or padded <= self.max_batch_tokens
            if len(batch) < self.max_batch_size and key not in seen and fits:
                seen.add(key)
                batch.append(item)
                longest, total = max(longest, cost), total + cost
            else:
                rest.append(item)
        self._pending = rest
        return batch


class Joins(Generic[C]):
    """The calls offered to a running pass (ContinuousBatcher's `joinable`), as its worker takes them."""

    def __init__(self, batcher: ContinuousBatcher[C, Any], loop: asyncio.AbstractEventLoop):
        self._batcher, self._loop = batcher, loop

    def take(self, rows: int) -> list[tuple[C, Callable[[Any], None]]]:
        """Up to max_batch_size - `rows` calls offered so far, each with its `answer(result)`: its
        result or error when done, or Requeue(call) to leave it to the next pass. On the worker thread."""
        batcher, out = self._batcher, []
        while len(out) < batcher.max_batch_size - rows:
            try:
                item = batcher._joiners.popleft()
            except IndexError:
                break
            if not item.future.done():  # not cancelled meanwhile
                out.append((item.call, functools.partial(self._loop.call_soon_threadsafe, batcher._answer_joiner, item)))
        return out
