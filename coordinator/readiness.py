"""Whether the coordinator can serve: its target answers health checks. The draft is reported only.

A coordinator whose target is down fails every request, so it must not look ready: load balancers
and Kubernetes should send to a replica that can serve. Its readiness follows the target's own
`grpc.health.v1` answer, asked on the channel requests use (so TLS, a fleet of replicas and
reconnect back-off are those of real calls), by a background task once a second: probes read the
last answer and never cost a call of their own.

A missing draft does not make the coordinator unready: speculation is optional, and without a
draft the target decodes alone with identical output, only slower. Failing readiness for it would
turn a slowdown into an outage. It is reported in HTTP /health's body instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = structlog.get_logger(__name__)

CHECK_INTERVAL_S = 1.0
# A loaded target answers health checks from its event loop, beside the model's worker thread, so
# a slow answer means an unreachable or stuck target, not a busy one.
CHECK_TIMEOUT_S = 2.0


class BackendHealth:
    """The last health answers of the target and the draft service (None: no draft service)."""

    def __init__(self, target: grpc.aio.Channel, draft: grpc.aio.Channel | None = None,
                 on_target: Callable[[bool], Awaitable[None]] | None = None,
                 interval_s: float = CHECK_INTERVAL_S, timeout_s: float = CHECK_TIMEOUT_S):
        """`on_target(up)` hears each change of the target's state (the coordinator's gRPC health)."""
        self._target = health_pb2_grpc.HealthStub(target)
        self._draft = health_pb2_grpc.HealthStub(draft) if draft is not None else None
        self.on_target, self.interval_s, self.timeout_s = on_target, interval_s, timeout_s
        self.target_up = True  # both answered just before the coordinator started serving
        self.draft_up: bool | None = True if draft is not None else None

    async def _serving(self, stub) -> bool:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def check(self) -> None:
        """Asks both once and records the answers."""
        stubs = [self._target] if self._draft is None else [self._target, self._draft]
        target_up, *draft = await asyncio.gather(*(self._serving(stub) for stub in stubs))
        draft_up = draft[0] if draft else None
        if draft_up != self.draft_up:
            log.warning("draft service unreachable: the target decodes alone" if not draft_up else "draft service back")
        self.draft_up = draft_up
        if target_up != self.target_up:
            log.warning("target unreachable: not ready" if not target_up else "target back: ready")
            self.target_up = target_up
            if self.on_target is not None:
                await self.on_target(target_up)

    async def watch(self) -> None:
        """Checks every `interval_s` until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)

    def status(self) -> dict:
        """HTTP /health's body fields for the backends."""
        state = {True: "ok", False: "unavailable", None: "none"}
        return {"target": state[self.target_up], "draft": state[self.draft_up]}
