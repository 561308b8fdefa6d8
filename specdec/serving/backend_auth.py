"""A shared token between the services (`--backend-token`), beside mutual TLS.

Without it, anyone who can reach the draft's or the target's port can open, step and release
sequences there. With it, the draft and the target refuse every call whose metadata lacks
`authorization: Bearer <token>` (UNAUTHENTICATED), and every client of theirs (the coordinator,
and a target with --draft) sends it on every call. A token is not encryption: across a network
others can read, it is read too, so there it goes with TLS.

Health (`grpc.health.v1`) stays open: kubelet's gRPC probes cannot send metadata, and neither do
the health checks gRPC itself makes for a fleet's channel (clients.py, `healthCheckConfig`). A
health answer tells nothing but up or down. Reflection does not stay open: no probe needs it, it
lists what a caller could do, and a person with grpcurl holds the token (`-H 'authorization:
Bearer ...'`).
"""

from __future__ import annotations

import hmac

import grpc

AUTHORIZATION = "authorization"
OPEN_PREFIX = "/grpc.health.v1.Health/"


def cleaned(token: str) -> str:
    """The token without surrounding whitespace: a Kubernetes Secret made `--from-file` keeps the
    file's trailing newline, which is no part of the token."""
    return token.strip()


def _presented(metadata) -> bytes:
    """The credentials of the first `authorization` entry in the Bearer scheme (any case), else b""."""
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            scheme, _, credentials = str(value).strip().partition(" ")
            return credentials.strip().encode("utf-8", "surrogatepass") if scheme.lower() == "bearer" else b""
    return b""


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call but health checks that does not carry the token.

    The refusal is a handler that aborts without parsing the request: a caller without the token
    costs no deserializing and reaches no servicer (nor the drain's count of calls)."""

    def __init__(self, token: str):
        self._token = cleaned(token).encode()
        if not self._token:
            raise ValueError("RequireToken needs a token")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler
        # compare_digest: the time taken does not tell a caller how much of its guess was right.
        if hmac.compare_digest(_presented(details.invocation_metadata), self._token):
            return handler
        return _refusal(handler)


async def _refuse(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service requires the backend token "
                                                         "(metadata `authorization: Bearer <token>`; --backend-token)")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only refuses. No deserializer: the request stays
    unread bytes. (gRPC awaits a coroutine handler of a streaming kind as one that writes itself.)"""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_refuse)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    return grpc.stream_stream_rpc_method_handler(_refuse)


class _WithToken:
    """A channel's multi-callable whose every call also carries the token's metadata."""

    def __init__(self, call, extra: tuple[tuple[str, str], ...]):
        self._call, self._extra = call, extra

    def __call__(self, *args, metadata=None, **kwargs):
        return self._call(*args, metadata=(*(metadata or ()), *self._extra), **kwargs)


class TokenChannel(grpc.aio.Channel):
    """A grpc.aio channel whose every call carries `authorization: Bearer <token>`.

    Metadata added where the stubs make their calls, not by a client interceptor: grpc.aio's
    stream-stream interceptors pass each message written through a queue and a task of their own,
    and the step sessions and the Decode and Drafts streams write a message a step."""

    def __init__(self, channel: grpc.aio.Channel, token: str):
        self._channel = channel
        self._extra = ((AUTHORIZATION, f"Bearer {cleaned(token)}"),)

    async def __aenter__(self):
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb):
        return await self._channel.__aexit__(exc_type, exc_val, exc_tb)

    async def close(self, grace: float | None = None):
        return await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False):
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state):
        return await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self):
        return await self._channel.channel_ready()

    def unary_unary(self, *args, **kwargs):
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._extra)

    def unary_stream(self, *args, **kwargs):
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._extra)

    def stream_unary(self, *args, **kwargs):
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._extra)

    def stream_stream(self, *args, **kwargs):
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._extra)


def authorized(channel: grpc.aio.Channel, token: str) -> grpc.aio.Channel:
    """`channel`, carrying `token` on every call; the channel itself when the token is empty (off)."""
    return TokenChannel(channel, token) if cleaned(token) else channel


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata of one call with `token` (none when it is empty): for the tools' blocking channels."""
    return ((AUTHORIZATION, f"Bearer {cleaned(token)}"),) if cleaned(token) else ()
