"""uvicorn's h11 protocol with the two guards it lacks: a deadline for a request's headers, and a cap
on one client's open connections.

Why: uvicorn times out idle keep-alive connections but not a request whose headers never finish.
A chaos run held 500 connections open, each sending one header byte every few seconds
(slowloris), and the server closed none of them. Here each connection must deliver a whole request
head within `header_timeout_s` of opening (or of its last response), and a client (an IP address:
nothing else is known before the headers) may hold at most `max_per_client` connections; past
either the connection is closed.
"""

from __future__ import annotations

import asyncio
import collections

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)


def guarded_protocol(header_timeout_s: float, max_per_client: int) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) with these limits; 0 turns one off."""
    per_client: collections.Counter[str] = collections.Counter()

    class GuardedProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._host = self.client[0] if self.client else "?"
            per_client[self._host] += 1
            if max_per_client and per_client[self._host] > max_per_client:
                log.warning("closing a connection past the per-client cap", client=self._host, cap=max_per_client)
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            per_client[self._host] -= 1
            if per_client[self._host] <= 0:
                del per_client[self._host]
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the request's head arrived

        def on_response_complete(self) -> None:
            self._arm()  # the next request on this connection gets the same deadline (a pipelined one disarms it at once)
            super().on_response_complete()

        def _arm(self) -> None:
            self._disarm()
            if header_timeout_s and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                log.info("closing a connection whose request head did not arrive in time", client=self._host,
                         header_timeout_s=header_timeout_s)
                self.transport.close()

    return GuardedProtocol
