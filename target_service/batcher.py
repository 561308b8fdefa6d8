"""Continuous batching of Verify calls: the calls waiting when the model frees up run as ONE pass.

Runs in the servicer's event loop (no gRPC here). One batch is in flight at a time, on the engine's
worker thread; calls that arrive meanwhile wait and form the next batch, so sequences join and leave
at any step. Before starting a batch it waits a short while for the calls it expects: every
sequence active lately (a Verify within the last few batches, and not released since) that has
no call pending yet. After a batch of 8 returns, the 8 coordinator loops each call the draft and
come back some ms apart; a batch started on the first arrival would split them into two half
batches, and a batcher that only waits for as many calls as its last batch had would let the
halves alternate for good (measured with 8 streams on 2 CPU cores: a mean of 3.6 sequences in the batch
of each Verify call, 6.3 after this change, warm-up batches of 2 included). The wait
ends when every active sequence has a call pending, or after `window_s` or a quarter of the last
batch's compute, whichever is longer: a row that misses the pass waits a whole pass instead.

A call from the only active sequence, with the model free, runs straight from its own task: no
batch can form, and the two hops to the batcher's task and back cost ~55 us of a ~1 ms exchange
(timestamps inside the target, 150 single-token Verify calls, two rounds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from target_service.engine import StepResult, VerifyCall

log = structlog.get_logger(__name__)


@dataclasses.dataclass
class _Pending:
    call: VerifyCall
    future: asyncio.Future


class VerifyBatcher:
    def __init__(self, run, verify_batch, window_s: float = 0.002, max_batch_size: int = 16, max_batch_tokens: int = 256):
        """`run(fn, *args)` awaits fn on the engine's worker; `verify_batch(calls)` is the engine's."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._run, self._verify_batch = run, verify_batch
        self.window_s, self.max_batch_size, self.max_batch_tokens = window_s, max_batch_size, max_batch_tokens
        self._pending: list[_Pending] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._active: dict[str, float] = {}  # sequence id -> time of its last Verify (monotonic)
        self._last_compute_s = 0.0
        self._running = False  # a pass is on the worker (from the loop, or a call run directly)

    async def submit(self, call: VerifyCall) -> StepResult:
        """Queues the call for the next batch and returns its own result (or raises its own error)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="verify-batcher")
        # A sequence seen before, alone and with the model free, has no batch to wait for. (A new one
        # goes through the window: others may be arriving with it, as when many streams start.)
        alone = not self._running and not self._pending and call.sequence_id in self._active \
            and self._expected() <= {call.sequence_id}
        self._active[call.sequence_id] = time.monotonic()
        if alone:
            return await self._run_alone(call)
        item = _Pending(call, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._arrived.set()
        return await item.future  # cancelled while waiting: the batch skips it

    async def _run_alone(self, call: VerifyCall) -> StepResult:
        """The only active sequence's call, with the model free: there is no batch to form, so it
        runs from the caller's task, without the hops to the batcher's task and back."""
        self._running = True
        try:
            result = (await self._run(self._verify_batch, [call], True))[0]
        finally:
            self._running = False
            if self._pending:  # calls that arrived meanwhile: the loop takes them now
                self._arrived.set()
        if isinstance(result, BaseException):
            raise result
        self._last_compute_s = result.compute_seconds
        return result

    def released(self, sequence_id: str) -> None:
        """A sequence left: do not wait for its next call."""
        self._active.pop(sequence_id, None)

    def _expected(self) -> set[str]:
        """The sequences the next batch should hold: those that called lately. One that stops
        calling without a Release (its coordinator vanished) drops out after a few batches' time."""
        horizon = time.monotonic() - max(1.0, 4 * self._last_compute_s)
        for sequence_id in [s for s, seen in self._active.items() if seen < horizon]:
            del self._active[sequence_id]
        return set(self._active)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            if not self._pending or self._running:  # a call run alone sets _arrived when it is done
                continue
            await self._gather_window()
            batch = self._take()
            if not batch:
                continue
            # Decoding ahead would hold the other active sequences' next calls up: only when alone.
            alone = len(self._expected()) <= 1
            self._running = True
            try:
                results = await self._run(self._verify_batch, [item.call for item in batch], alone)
            except Exception as exc:  # noqa: BLE001 - a failed pass fails its rows, never the batcher
                results = [exc] * len(batch)
            finally:
                self._running = False
            for item, result in zip(batch, results):
                if item.future.done():
                    continue
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
            ok = [r for r in results if isinstance(r, StepResult)]
            self._last_compute_s = max((r.compute_seconds for r in ok), default=0.0)
            if self._pending:
                self._arrived.set()

    async def _gather_window(self) -> None:
        wait_s = max(self.window_s, self._last_compute_s / 4)
        deadline = time.monotonic() + wait_s
        expected = self._expected()
        target = min(self.max_batch_size, max(1, len(expected)))
        while len({item.call.sequence_id for item in self._live()} & expected) < target:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _live(self) -> list[_Pending]:
        self._pending = [item for item in self._pending if not item.future.done()]  # drop cancelled calls
        return self._pending

    def _take(self) -> list[_Pending]:
        """Up to max_batch_size calls, oldest first, one per sequence (a second call for the same
        sequence, a late retry, waits for the next batch: rows must not share a cache).

        Rows are padded to the longest row's new tokens, so the batch costs rows x longest; past
        max_batch_tokens a row waits for the next batch (the oldest always goes). That keeps a
        700-token prefill from padding seven one-token decode rows to 700 each: prefill is
        compute-bound anyway, so batching it gains nothing on a CPU and could overrun deadlines.
        """
        batch, seen, rest, longest = [], set(), [], 0
        for item in self._live():
            new = item.call.new_positions
            fits = not batch or (len(batch) + 1) * max(longest, new) <= self.max_batch_tokens
            if len(batch) < self.max_batch_size and item.call.sequence_id not in seen and fits:
                seen.add(item.call.sequence_id)
                batch.append(item)
                longest = max(longest, new)
            else:
                rest.append(item)
        self._pending = rest
        return batch
