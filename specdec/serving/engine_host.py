"""The engine's place in a servicer: it arrives after the server starts, and one worker thread runs
every model call in arrival order, off the event loop (the draft's and the target's servicers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import structlog

from specdec.errors import Unavailable

log = structlog.get_logger(__name__)


# The longest wait between two sweeps for idle sequences: a short --idle-timeout-s is swept every
# quarter of itself, a long one (the default) at most this late.
MAX_SWEEP_INTERVAL_S = 30.0


class EngineHost:
    """What the draft and target servicers share: an engine that arrives after the server starts,
    and one worker thread that runs every model call in arrival order, off the event loop.

    The servicer is registered before the server starts (gRPC wants handlers first), so until
    `attach` it answers UNAVAILABLE while health says NOT_SERVING.
    """

    def __init__(self, role: str):
        self.role = role
        self._engine = None
        self.info = None
        from specdec.serving.threads import enter_compute_thread  # torch's threads belong to this worker (specdec/serving/threads.py)

        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=role,
                                                              initializer=enter_compute_thread)

        # Calls handed to the worker and not finished there, cancelled or not: while any is left the
        # worker may be touching the engine, so nothing else may (`idle`).
        self._in_flight: set[concurrent.futures.Future] = set()
        self._urgent: set[concurrent.futures.Future] = set()  # of those, the ones `queued` counts

    def attach(self, engine, info) -> None:
        self.info = info
        self._engine = engine

    @property
    def idle(self) -> bool:
        """No call is on the worker or queued for it. Only the event loop hands the worker work, so
        while the loop runs something synchronously after seeing `idle`, the engine is its alone."""
        return not self._in_flight

    @property
    def engine(self):
        if self._engine is None:
            raise Unavailable(f"the {self.role} model is still loading")
        return self._engine

    def queued(self) -> bool:
        """Whether a call waits for the worker behind the one it runs: a pass doing extra work for
        its own rows (the target decoding ahead) stops then, so a Release or another sequence's call
        does not wait out a long run of passes decoded ahead for a request answered whole. Safe to
        call from the worker (a set's length). Work run as `background` (a finished sequence's
        release) does not count: it waits for the passes to end."""
        return len(self._urgent) > 1

    def sweep_idle(self, store) -> asyncio.Task | None:
        """Expires `store`'s idle sequences on a timer until the returned task is cancelled (None:
        the store has no idle timeout). The store expires them on every sync too, but a coordinator
        that was SIGKILLed sends no more calls: its sequences, 10 in the target and 4 in the draft
        (46 MiB), stayed until some other call came. The sweep runs on the worker, in line with the
        model calls, since the store is not thread-safe."""
        if store.idle_timeout_s <= 0:
            return None
        interval = min(store.idle_timeout_s / 4, MAX_SWEEP_INTERVAL_S)

        async def sweep() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.run(store.expire_idle)
                except Exception:  # noqa: BLE001 - the next sweep tries again; the calls' own expiry still runs
                    log.exception("idle sweep failed")

        return asyncio.get_running_loop().create_task(sweep(), name=f"{self.role}-idle-sweep")

    async def run(self, fn, *args, background: bool = False):
        """fn(*args) on the worker, after what is queued there. `background`: nobody waits on it
        (freeing a finished sequence), so it does not stop passes that decode ahead (`queued`)."""
        future = self.executor.submit(fn, *args)
        self._in_flight.add(future)
        # Discarded in the worker the moment fn returns (done callbacks run in the thread that
        # finishes the future), not when the awaiting task resumes: a cancelled caller stops
        # waiting at once, but its fn may still be running.
        future.add_done_callback(self._in_flight.discard)
        if not background:
            self._urgent.add(future)
            future.add_done_callback(self._urgent.discard)
        return await asyncio.wrap_future(future)
