"""What the users of one multiplexed stream ask to send, merged into one message per turn of the
event loop (the coordinator's Decode stream, the target's Drafts stream).

Why: a stream that carries many sequences pays per message (a write, a wake-up at the far end),
not per sequence in it. Asks made while the last message was being written, or in the same turn
of the event loop, leave together, so N sequences stepping together cost one message, not N.
grpc.aio also takes one write at a time on a call, which a single writer gives for free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

log = structlog.get_logger(__name__)


class Outbox:
    """`pending` is the next message: append to its fields, then `changed()`. `pump(call, live)`
    writes it while `live()`; `sent` counts the messages written."""

    def __init__(self, make: Callable[[], object], name: str):
        self._make, self.name = make, name
        self.pending = make()
        self._wake = asyncio.Event()
        self.sent = 0

    def changed(self) -> None:
        self._wake.set()

    async def pump(self, call, live: Callable[[], bool]) -> None:
        try:
            while live():
                await self._wake.wait()
                if not live():  # the stream was replaced: what waits is the new stream's to send
                    return
                self._wake.clear()
                message, self.pending = self.pending, self._make()
                if message.ByteSize():  # something was asked (an empty message is all defaults)
                    await call.write(message)
                    self.sent += 1
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.info("stream closed for writing", stream=self.name, error=str(exc))


class StreamClient:
    """The client end of one long-lived bidirectional call that many users share: opened on first
    use (`_ensure`) and again after it broke, its writes merged by an Outbox, its answers read by
    the subclass's `_read(call)`, which calls `_ended(call)` when that call is over."""

    def __init__(self, open_call: Callable[[], object], make_request: Callable[[], object], name: str):
        self._open_call = open_call
        self._call = None
        self._outbox = Outbox(make_request, name)
        self._tasks: set[asyncio.Task] = set()
        self.messages_in = 0  # answers read

    @property
    def messages_out(self) -> int:
        """Requests written."""
        return self._outbox.sent

    def _ensure(self) -> None:
        if self._call is not None:
            return
        call = self._call = self._open_call()
        loop = asyncio.get_running_loop()
        for task in (loop.create_task(self._read(call)), loop.create_task(self._outbox.pump(call, lambda: self._call is call))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _ended(self, call) -> None:
        """`call` is over: the next use opens another, and its writer stops."""
        if self._call is call:
            self._call = None
            self._outbox.changed()

    async def _read(self, call) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
