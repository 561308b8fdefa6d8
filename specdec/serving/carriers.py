"""Sequences freed when the stream that carried them ends.

Why: the coordinator steps each sequence on a session stream of its own (VerifySession,
ProposeSession) and releases it when its request ends. A coordinator that dies sends no Release,
and its sequences' KV caches stayed held until --idle-timeout-s swept them: ten minutes of memory
per crash in a fleet. The end of the stream is the signal that needs no lease to renew: a process
that exits or crashes resets its connections, and gRPC cancels their streams on the server; a host
that vanishes without a reset stops answering the server's keepalive pings (rpc.KEEPALIVE_OPTIONS),
and its connection is closed the same way. The coordinator closes a sequence's stream
only when it is done with the sequence or after a failed step (the next step then re-sends the
sequence whole, as after a lost target). It also closes one when it drops a draft it asked for
ahead of time, and steps the sequence again on a new stream moments later: so a sequence is freed
only where, GRACE_S after its stream ended, no newer stream or call has carried it since.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)

# Long enough for a live coordinator to step a sequence again after closing its stream (its next
# step waits for at most one target pass), short beside the idle sweep this replaces for crashes.
GRACE_S = 5.0


class Carriers:
    """Which open stream last carried each sequence; `ended` frees what a closing stream still carries."""

    def __init__(self, release: Callable[[str], Awaitable[object]], grace_s: float = GRACE_S):
        self._release, self.grace_s = release, grace_s
        self._carrier: dict[str, object] = {}
        self._tasks: set[asyncio.Task] = set()

    def carry(self, sequence_id: str, stream: object) -> None:
        self._carrier[sequence_id] = stream

    def forget(self, sequence_id: str) -> None:
        """The sequence was released by a call: no stream carries it any more."""
        self._carrier.pop(sequence_id, None)

    def __len__(self) -> int:
        return len(self._carrier)

    def ended(self, stream: object, sequence_ids) -> None:
        """`stream` ended: in GRACE_S, release each of `sequence_ids` that no newer stream or call
        has carried meanwhile, in a task of its own (the stream's handler may be ending because it
        was cancelled, and must not wait)."""
        carried = [s for s in sequence_ids if self._carrier.get(s) is stream]
        if not carried:
            return
        task = asyncio.get_running_loop().create_task(self._free(stream, carried))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _free(self, stream: object, sequence_ids: list[str]) -> None:
        await asyncio.sleep(self.grace_s)
        orphans = [s for s in sequence_ids if self._carrier.get(s) is stream]
        if orphans:
            log.info("releasing the sequences of a stream that ended", sequences=len(orphans))
        for sequence_id in orphans:
            del self._carrier[sequence_id]
            try:
                await self._release(sequence_id)
            except Exception:  # noqa: BLE001 - the idle timeout frees it eventually
                log.warning("release failed", sequence_id=sequence_id, exc_info=True)
