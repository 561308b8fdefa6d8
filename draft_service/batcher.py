"""Continuous batching of draft forwards: the chains being drafted at once share ONE forward per token.

Why: under load the draft service holds many Propose streams at the same time, each asking for one
forward per drafted token. One by one, each forward is a matrix-vector product that leaves the
hardware idle (decoding is memory-bound); stacked as rows of one batch, the weights are read once
for all of them. Measured on the target's batched path (specdec/forward/batching.py) on 2 CPU cores: 8
rows in one pass cost ~0.35x of 8 single passes.

Runs in the servicer's event loop (no gRPC here). A stream registers with `opened()`, then asks
`logits(seq)` once per token; the batcher waits until every open stream has asked (they come back
microseconds apart once a batch returns: choosing a token and sending it is all they do between
two asks), or a short window passes, then runs the waiting rows as one pass on the engine's worker.
Streams join and leave at any token: a new stream's catch-up tokens (a whole prompt, on its first
call) simply make its row longer, capped by `max_batch_tokens` as in the target's batcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import torch

from specdec.kv.store import Sequence


@dataclasses.dataclass
class _Pending:
    seq: Sequence
    future: asyncio.Future

    @property
    def new_positions(self) -> int:
        return len(self.seq.tokens) - self.seq.cached


class DraftBatcher:
    def __init__(self, run, forward_rows, window_s: float = 0.002, max_batch_size: int = 16, max_batch_tokens: int = 256):
        """`run(fn, *args)` awaits fn on the engine's worker; `forward_rows(seqs)` is the engine's."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._run, self._forward_rows = run, forward_rows
        self.window_s, self.max_batch_size, self.max_batch_tokens = window_s, max_batch_size, max_batch_tokens
        self._pending: list[_Pending] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._open = 0  # streams between opened() and closed(): the rows the next batch expects
        self._last_compute_s = 0.0
        self.batches = 0  # forward passes run, and rows they carried (tests and metrics read these)
        self.rows = 0

    def opened(self) -> None:
        self._open += 1

    def closed(self) -> None:
        self._open = max(0, self._open - 1)
        self._arrived.set()  # the batch being gathered may have been waiting for this stream

    async def logits(self, seq: Sequence) -> torch.Tensor:
        """Feeds the sequence's pending tokens in the next batch; its next-token logits [V]."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="draft-batcher")
        item = _Pending(seq, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._arrived.set()
        return await item.future  # cancelled while waiting: the batch skips it

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            if not self._live():
                continue
            await self._gather_window()
            batch = self._take()
            if not batch:
                continue
            started = time.perf_counter()
            try:
                results = await self._run(self._forward_rows, [item.seq for item in batch])
            except Exception as exc:  # noqa: BLE001 - a failed pass fails its rows, never the batcher
                results = [exc] * len(batch)
            self._last_compute_s = time.perf_counter() - started
            self.batches += 1
            self.rows += len(batch)
            for item, result in zip(batch, results):
                if item.future.done():
                    continue
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
            if self._pending:
                self._arrived.set()

    async def _gather_window(self) -> None:
        """Waits, up to the window, until every open stream has a row waiting."""
        deadline = time.monotonic() + max(self.window_s, self._last_compute_s / 10)
        while len(self._live()) < min(self.max_batch_size, max(1, self._open)):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _live(self) -> list[_Pending]:
        self._pending = [item for item in self._pending if not item.future.done()]  # drop cancelled asks
        return self._pending

    def _take(self) -> list[_Pending]:
        """Up to max_batch_size rows, oldest first, one per sequence (two rows must not share a
        cache); past max_batch_tokens padded positions a row waits for the next pass (the oldest
        always goes), so one long prefill does not pad every one-token row to its length."""
        batch, seen, rest, longest = [], set(), [], 0
        for item in self._live():
            new = item.new_positions
            fits = not batch or (len(batch) + 1) * max(longest, new) <= self.max_batch_tokens
            if len(batch) < self.max_batch_size and id(item.seq) not in seen and fits:
                seen.add(id(item.seq))
                batch.append(item)
                longest = max(longest, new)
            else:
                rest.append(item)
        self._pending = rest
        return batch
