"""gRPC clients for the draft and target services: deadlines, retries, request ids, byte counts.

They implement the loop's Proposer and Verifier protocols, and turn NOT_FOUND into SequenceNotFound
so the loop re-fills a sequence a service lost. Verify and Propose are safe to retry: each names the
prefix it builds on, so a repeated call crops to it and computes the same thing again.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import os
import socket
import time
from collections.abc import Callable

import grpc
import structlog

from coordinator.decode_stream import DecodeStream, StreamPerRun
from coordinator.protocol import DraftOutcome, Progress
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.errors import DeadlineExceeded, SequenceNotFound
from specdec.serving.backend_auth import authorized
from specdec.serving.rpc import CHANNEL_OPTIONS
from specdec.serving.logs import REQUEST_ID_METADATA
from specdec.serving.wire import dists_from_proto, propose_call_to_proto, verify_call_to_proto, verify_result_from_proto
from specdec.calls.request import ProposeCall, VerifyCall, VerifyResult

log = structlog.get_logger(__name__)

# Transparent retries of calls that failed with UNAVAILABLE (a restart, a dropped connection).
# Deadlines are set per call, not here: a service config with both misbehaves in grpcio 1.85.
_RETRY_POLICY = {
    "name": [{"service": "specdec.v1.DraftService"}, {"service": "specdec.v1.TargetService"}],
    "retryPolicy": {
        "maxAttempts": 3,
        "initialBackoff": "0.05s",
        "maxBackoff": "0.5s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    },
}

# Sequence affinity across replicas is gRPC's own: the ring_hash policy hashes this header, which
# every call about a sequence carries, onto a ring of the resolved endpoints, so a sequence's calls
# all reach the replica holding its KV cache, and a replica that goes away moves only its own
# sequences (the next replica answers NOT_FOUND and the loop re-fills them). Client-side health
# checking takes a replica that reports NOT_SERVING (loading, draining) off the ring. Hashing a
# header needs this experiment switched on in gRPC; it is read when a channel is built.
SEQUENCE_METADATA = "x-specdec-sequence"
os.environ.setdefault("GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY", "true")
_FLEET_POLICY = {
    "loadBalancingConfig": [{"ring_hash_experimental": {"requestHashHeader": SEQUENCE_METADATA}}],
    "healthCheckConfig": {"serviceName": ""},
}


def channel_target(address: str) -> tuple[str, bool]:
    """(the gRPC target for an address flag, whether it may name several replicas).

    `host:port` is one replica. A comma-separated list is a fleet: its names are resolved once, here
    (`ipv4:`/`ipv6:` targets take addresses only). A `dns:///name:port` target is a fleet gRPC
    resolves itself, again when connections fail: a headless Service's name, whose pods come and go."""
    endpoints = [a.strip() for a in address.split(",") if a.strip()]
    if address.startswith("dns:"):
        return address, True
    if len(endpoints) <= 1:
        return (endpoints[0] if endpoints else address.strip()), False
    resolved = [_resolve(endpoint) for endpoint in endpoints]
    families = {family for family, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"{address!r}: mixes IPv4 and IPv6 endpoints; list one family, or use a dns:/// name")
    return f"{families.pop()}:" + ",".join(endpoint for _, endpoint in resolved), True


def _resolve(endpoint: str) -> tuple[str, str]:
    """("ipv4" or "ipv6", "address:port") of one `host:port`."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{endpoint!r}: expected host:port")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{endpoint!r}: cannot resolve {host!r} ({exc})") from exc
    family, *_, sockaddr = infos[0]
    return ("ipv6", f"[{sockaddr[0]}]:{port}") if family == socket.AF_INET6 else ("ipv4", f"{sockaddr[0]}:{port}")


# gRPC's reconnect back-off grows to two minutes while a service is down, so a restarted draft
# could sit unused (and a restarted target refuse work) for that long; cap it at two seconds.
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None, token: str = "") -> grpc.aio.Channel:
    """A channel to one service, or to its replicas (see channel_target) with sequence affinity;
    every call on it carries `token` (--backend-token) when one is given."""
    target, fleet = channel_target(address)
    config = {"methodConfig": [_RETRY_POLICY], **(_FLEET_POLICY if fleet else {})}
    options = [*CHANNEL_OPTIONS, *_RECONNECT_OPTIONS, ("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1)]
    if credentials is not None:
        return authorized(grpc.aio.secure_channel(target, credentials, options=options), token)
    return authorized(grpc.aio.insecure_channel(target, options=options), token)


# The client's deadline (time.monotonic() seconds) of the request being served, if it set one: every
# internal call gets at most what remains of it, so a client deadline holds end to end.
REQUEST_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)
RELEASE_TIMEOUT_S = 5.0  # releases run even after a request's deadline passed (cleanup must happen)


def call_timeout(limit: float) -> float:
    deadline = REQUEST_DEADLINE.get()
    if deadline is None:
        return limit
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return min(limit, remaining)


# A step's call gets --rpc-timeout-s. A call that also feeds a long prompt gets that much per this
# many positions it feeds: the target feeds a long prompt in chunks with the other sequences' steps
# between them (chunked prefill), so on a busy CPU a 4,000-token prompt progresses for minutes, and
# a single step's timeout cut such requests off while they were being served.
PREFILL_POSITIONS_PER_TIMEOUT = 256


def step_timeout(limit: float, positions: int) -> float:
    """The timeout of a call that feeds `positions` new tokens (within the request's deadline)."""
    return call_timeout(limit * max(1, math.ceil(positions / PREFILL_POSITIONS_PER_TIMEOUT)))


def _metadata(sequence_id: str) -> tuple[tuple[str, str], ...]:
    """The request id (for the services' logs) and the sequence (what a fleet's ring hashes)."""
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    return ((SEQUENCE_METADATA, sequence_id), *(((REQUEST_ID_METADATA, str(request_id)),) if request_id else ()))


# A target that restarts (a crash, a rolling update) answers UNAVAILABLE until it is back. Verify is
# retried for up to this long after the first such failure (never past the request's deadline), so
# requests ride through a quick restart instead of failing; the channel's retry policy above only
# covers a blip (three attempts within a second). A target down for longer still fails requests
# with UNAVAILABLE, after this bound (the coordinator's --target-retry-s; this is its default).
TARGET_RETRY_S = 10.0


def target_went_away(exc: grpc.aio.AioRpcError) -> bool:
    """A failure a restarting target causes: UNAVAILABLE, or UNKNOWN "Stream removed", which gRPC
    reports for some streams on a connection reset by the peer instead of UNAVAILABLE
    (grpc/grpc#34076). tests/test_netns.py kills the target mid-step: in one run of seven, 6 of 7
    open sessions failed UNAVAILABLE "Stream removed (recvmsg:Connection reset by peer)" and were
    retried, while the 7th request failed at once with no retry logged."""
    code = exc.code()
    return code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.UNKNOWN and (exc.details() or "").startswith("Stream removed"))


class Sessions:
    """One open bidirectional stream per sequence for a method called every step (VerifySession,
    ProposeSession): a unary call pays a call's set-up every time, an exchange on an open stream
    only the messages. A stream has no deadline of its own, since it lives as long as its sequence;
    each exchange gets the timeout the per-step call would have had, and fails as that call would
    (an AioRpcError with the server's status). Any failure, cancellation included, closes the
    stream: an answer still on its way would otherwise answer the next request.
    """

    def __init__(self, open_stream: Callable[..., grpc.aio.StreamStreamCall], name: str):
        self._open, self.name = open_stream, name
        self.enabled = True  # until a server answers UNIMPLEMENTED (a release before sessions)
        self._calls: dict[str, grpc.aio.StreamStreamCall] = {}

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    async def exchange(self, sequence_id: str, message, timeout: float):
        """The answer to `message`; None if the server has no session method (use the unary one)."""
        call = self._calls.get(sequence_id)
        if call is None:
            call = self._calls[sequence_id] = self._open(metadata=_metadata(sequence_id))
        try:
            async with asyncio.timeout(timeout):
                await call.write(message)
                response = await call.read()
            if response is grpc.aio.EOF:
                raise await self._ended(call)
        except BaseException as exc:
            self.close(sequence_id)
            if isinstance(exc, TimeoutError):
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           f"{self.name} took longer than {timeout:.3g} s") from exc
            if isinstance(exc, asyncio.InvalidStateError):  # written to a stream that had already ended
                exc = await self._ended(call)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.enabled = False
                log.info("the server has no session method; using one call per step", method=self.name)
                return None
            raise exc
        return response

    @staticmethod
    async def _ended(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
        code = await call.code()
        if code == grpc.StatusCode.OK:  # closed without an error mid-sequence: the server is going away
            code = grpc.StatusCode.UNAVAILABLE
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details())

    def close(self, sequence_id: str) -> None:
        call = self._calls.pop(sequence_id, None)
        if call is not None:
            call.cancel()

    def close_all(self) -> None:
        for sequence_id in list(self._calls):
            self.close(sequence_id)


class TargetClient:
    def __init__(self, address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None, retry_s: float = TARGET_RETRY_S,
                 token: str = ""):
        self.address = address
        self.channel = open_channel(address, credentials, token)
        self.stub = pb_grpc.TargetServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.sessions = Sessions(self.stub.VerifySession, "Verify")
        # Runs in the target share one stream; a fleet's replicas cannot be told apart on one
        # stream, so there each run has its own, routed by its sequence as every call is.
        self.decoder = (StreamPerRun(lambda sequence_id: self.stub.Decode(metadata=_metadata(sequence_id)), retry_s)
                        if channel_target(address)[1] else DecodeStream(self.stub.Decode, retry_s))

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        response = await self.stub.GetInfo(pb.TargetServiceGetInfoRequest(), timeout=timeout_s or self.timeout_s, wait_for_ready=True)
        return response.info

    async def verify(self, call: VerifyCall) -> VerifyResult:
        request = verify_call_to_proto(call)
        start = time.perf_counter()
        response = await self._verify_call(call.sequence_id, request)
        wall = time.perf_counter() - start
        return verify_result_from_proto(response, wall, request.ByteSize() + response.ByteSize())

    async def _verify_call(self, sequence_id: str, request: pb.VerifyRequest) -> pb.VerifyResponse:
        """One Verify, retried while the target is UNAVAILABLE (see TARGET_RETRY_S). Safe to repeat:
        the request names the prefix it builds on, and a restarted target answers NOT_FOUND, which
        the loop answers by re-sending the sequence."""
        give_up, pause = None, 0.1
        positions = len(request.append_tokens) + request.decode_ahead  # the passes decoded ahead take time too
        while True:
            try:
                if self.sessions.enabled:
                    response = await self.sessions.exchange(sequence_id, pb.VerifySessionRequest(verify=request),
                                                            step_timeout(self.timeout_s, positions))
                    if response is not None:
                        return response.verify
                return await self.stub.Verify(request, timeout=step_timeout(self.timeout_s, positions), metadata=_metadata(sequence_id))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise SequenceNotFound(sequence_id, exc.details() or "") from exc
                now = time.monotonic()
                give_up = give_up or now + self.retry_s
                deadline = REQUEST_DEADLINE.get()
                if not target_went_away(exc) or now + pause > min(give_up, deadline or give_up):
                    raise
                log.info("target unavailable; retrying", reason=exc.details(), pause_s=pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)

    async def release(self, sequence_id: str) -> None:
        self.sessions.close(sequence_id)
        await self.stub.Release(pb.TargetServiceReleaseRequest(sequence_id=sequence_id), timeout=RELEASE_TIMEOUT_S,
                                metadata=_metadata(sequence_id))

    async def close(self) -> None:
        self.sessions.close_all()
        if self.decoder is not None:
            await self.decoder.close()
        await self.channel.close()


class DraftClient:
    def __init__(self, address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None, token: str = ""):
        self.address = address
        self.channel = open_channel(address, credentials, token)
        self.stub = pb_grpc.DraftServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.sessions = Sessions(self.stub.ProposeSession, "Propose")

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        response = await self.stub.GetInfo(pb.DraftServiceGetInfoRequest(), timeout=timeout_s or self.timeout_s, wait_for_ready=True)
        return response.info

    async def propose(self, call: ProposeCall, progress: Progress | None = None) -> DraftOutcome:
        """A chain over Propose (a session's exchange, or the stream a run-ahead watches), or a tree
        over ProposeTree (call.tree)."""
        if call.tree is not None:
            return await self._propose_tree(call)
        sequence_id, append = call.sequence_id, call.append
        request = propose_call_to_proto(call)
        size = request.ByteSize()
        start = time.perf_counter()
        try:
            answer = None
            if progress is None and self.sessions.enabled:  # a run-ahead watches its tokens arrive: it streams
                answer = await self.sessions.exchange(sequence_id, pb.ProposeSessionRequest(propose=request),
                                                      step_timeout(self.timeout_s, len(append)))
            if answer is not None:
                messages = list(answer.tokens)
                size += answer.ByteSize()
                compute = answer.compute_seconds
            else:
                messages = []
                async for message in self.stub.Propose(request, timeout=step_timeout(self.timeout_s, len(append)),
                                                       metadata=_metadata(sequence_id)):
                    messages.append(message)
                    size += message.ByteSize()
                    if progress is not None:
                        progress.arrived(message.token_id)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise SequenceNotFound(sequence_id, exc.details() or "") from exc
            raise
        wall = time.perf_counter() - start
        tokens = [m.token_id for m in messages]
        dists = dists_from_proto(m.dist for m in messages)
        confidence = [m.cumulative_prob for m in messages]
        if answer is None:  # a stream says only what its last token had cost by then
            compute = messages[-1].compute_seconds if messages else 0.0
        return DraftOutcome(tokens, dists, compute, wall, size, confidence=confidence)

    async def _propose_tree(self, call: ProposeCall) -> DraftOutcome:
        request = propose_call_to_proto(call)
        start = time.perf_counter()
        try:
            response = await self.stub.ProposeTree(request, timeout=step_timeout(self.timeout_s, len(call.append)),
                                                   metadata=_metadata(call.sequence_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise SequenceNotFound(call.sequence_id, exc.details() or "") from exc
            raise
        wall = time.perf_counter() - start
        tree_pb = response.tree
        dists = dists_from_proto(tree_pb.child_dists)
        return DraftOutcome(list(tree_pb.tokens), dists, response.compute_seconds, wall,
                            request.ByteSize() + response.ByteSize(), parents=list(tree_pb.parents))

    async def release(self, sequence_id: str) -> None:
        self.sessions.close(sequence_id)
        await self.stub.Release(pb.DraftServiceReleaseRequest(sequence_id=sequence_id), timeout=RELEASE_TIMEOUT_S,
                                metadata=_metadata(sequence_id))

    async def close(self) -> None:
        self.sessions.close_all()
        await self.channel.close()
