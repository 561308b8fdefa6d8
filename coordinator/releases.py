"""Releasing a request's sequences in both services when it ends, in tasks a second cancellation
cannot stop, and waiting for those still running when the coordinator shuts down.

Apart from loop.py because it outlives a request: a handler cancelled twice returns before its
release does (`releases_done`). SpeculativeLoop takes Releases' methods in; they read its
`proposer` and `verifier`.
"""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger(__name__)


# Release tasks in flight, held so the event loop does not garbage-collect them before they finish.
_RELEASES: set[asyncio.Task] = set()


async def releases_done(timeout: float) -> None:
    """Waits (up to `timeout`) for the releases still running: a handler cancelled a second time
    returns before its release does, so a coordinator shutting down must not stop its loop on it."""
    if _RELEASES:
        await asyncio.wait(set(_RELEASES), timeout=timeout)


class Releases:
    """The release path of SpeculativeLoop (coordinator/loop.py)."""

    async def _release(self, sequence_id: str) -> None:
        """Releases the sequence in both services, in a task a second cancellation cannot stop.

        A cancelled request may be cancelled again while its `finally` awaits the releases (gRPC
        cancels the handler on the client's cancel and again on the deadline); awaiting them
        directly would then skip the remaining release and leak that service's cache.
        """
        task = asyncio.get_running_loop().create_task(self._release_all(sequence_id))
        _RELEASES.add(task)
        task.add_done_callback(_RELEASES.discard)
        await asyncio.shield(task)

    async def _release_all(self, sequence_id: str) -> None:
        services = [s for s in (self.proposer, self.verifier) if s is not None]
        results = await asyncio.gather(*(s.release(sequence_id) for s in services), return_exceptions=True)
        for service, result in zip(services, results):
            if isinstance(result, BaseException):  # the idle timeout frees it eventually
                log.warning("release failed", service=type(service).__name__, error=str(result))
