"""gRPC clients for the draft and target services: deadlines, retries, request ids, byte counts.

They implement the loop's Proposer and Verifier protocols, and turn NOT_FOUND into SequenceNotFound
so the loop re-fills a sequence a service lost. Verify and Propose are safe to retry: each names the
prefix it builds on, so a repeated call crops to it and computes the same thing again.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time

import grpc
import structlog

from coordinator.loop import DraftOutcome, Dist, Progress, TreeSpec, VerifyOutcome
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.errors import DeadlineExceeded, SequenceNotFound
from specdec.features import FeatureRows
from specdec.grpcutil import CHANNEL_OPTIONS
from specdec.logs import REQUEST_ID_METADATA
from specdec.sampling import SamplingConfig

log = structlog.get_logger(__name__)

# Transparent retries of calls that failed with UNAVAILABLE (a restart, a dropped connection).
# Deadlines are set per call, not here: a service config with both misbehaves in grpcio 1.85.
_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "specdec.v1.DraftService"}, {"service": "specdec.v1.TargetService"}],
        "retryPolicy": {
            "maxAttempts": 3,
            "initialBackoff": "0.05s",
            "maxBackoff": "0.5s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
})


# gRPC's reconnect back-off grows to two minutes while a service is down, so a restarted draft
# could sit unused (and a restarted target refuse work) for that long; cap it at two seconds.
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    options = [*CHANNEL_OPTIONS, *_RECONNECT_OPTIONS, ("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1)]
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)


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


def _metadata() -> tuple[tuple[str, str], ...]:
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    return ((REQUEST_ID_METADATA, str(request_id)),) if request_id else ()


def _sampling_proto(sampling: SamplingConfig) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed)


# A target that restarts (a crash, a rolling update) answers UNAVAILABLE until it is back. Verify is
# retried for up to this long after the first such failure (never past the request's deadline), so
# requests ride through a quick restart instead of failing; the channel's retry policy above only
# covers a blip (three attempts within a second). A target down for longer still fails requests
# with UNAVAILABLE, after this bound (the coordinator's --target-retry-s; this is its default).
TARGET_RETRY_S = 10.0


class TargetClient:
    def __init__(self, address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None, retry_s: float = TARGET_RETRY_S):
        self.address = address
        self.channel = open_channel(address, credentials)
        self.stub = pb_grpc.TargetServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.sessions = True  # VerifySession, until a target answers UNIMPLEMENTED (an older release)
        self._sessions: dict[str, grpc.aio.StreamStreamCall] = {}

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        response = await self.stub.GetInfo(pb.TargetServiceGetInfoRequest(), timeout=timeout_s or self.timeout_s, wait_for_ready=True)
        return response.info

    async def verify(self, sequence_id: str, known_len: int, append: list[int], draft_tokens: list[int],
                     draft_dists: list[Dist], sampling: SamplingConfig, return_features: bool = False) -> VerifyOutcome:
        request = pb.VerifyRequest(sequence_id=sequence_id, known_len=known_len, append_tokens=append,
                                   draft_tokens=draft_tokens, sampling=_sampling_proto(sampling), return_features=return_features)
        if not sampling.greedy and any(d is not None for d in draft_dists):
            for dist in draft_dists:
                ids, probs = dist if dist is not None else ([], [])
                request.draft_dists.add(token_ids=ids, probs=probs)
        start = time.perf_counter()
        response = await self._verify_call(sequence_id, request)
        wall = time.perf_counter() - start
        features = None
        if response.HasField("features"):
            f = response.features
            features = FeatureRows.from_wire(f.start, f.rows, f.dim, f.data, "VerifyResponse.features")
        return VerifyOutcome(response.accepted, response.next_token, response.compute_seconds, wall,
                             request.ByteSize() + response.ByteSize(), features=features)

    async def verify_tree(self, sequence_id: str, known_len: int, append: list[int], parents: list[int],
                          tokens: list[int], child_dists: list[Dist], sampling: SamplingConfig) -> VerifyOutcome:
        request = pb.VerifyRequest(sequence_id=sequence_id, known_len=known_len, append_tokens=append,
                                   sampling=_sampling_proto(sampling))
        request.draft_tree.parents.extend(parents)
        request.draft_tree.tokens.extend(tokens)
        if not sampling.greedy and any(d is not None for d in child_dists):
            for dist in child_dists:
                ids, probs = dist if dist is not None else ([], [])
                request.draft_tree.child_dists.add(token_ids=ids, probs=probs)
        start = time.perf_counter()
        response = await self._verify_call(sequence_id, request)
        wall = time.perf_counter() - start
        return VerifyOutcome(response.accepted, response.next_token, response.compute_seconds, wall,
                             request.ByteSize() + response.ByteSize(), tuple(response.accepted_path))

    async def _verify_call(self, sequence_id: str, request: pb.VerifyRequest) -> pb.VerifyResponse:
        """One Verify, retried while the target is UNAVAILABLE (see TARGET_RETRY_S). Safe to repeat:
        the request names the prefix it builds on, and a restarted target answers NOT_FOUND, which
        the loop answers by re-sending the sequence."""
        give_up, pause = None, 0.1
        while True:
            try:
                if self.sessions:
                    try:
                        return await self._exchange(sequence_id, request)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                            raise
                        self.sessions = False
                        log.info("the target has no VerifySession; using unary Verify calls")
                return await self.stub.Verify(request, timeout=call_timeout(self.timeout_s), metadata=_metadata())
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise SequenceNotFound(sequence_id, exc.details() or "") from exc
                now = time.monotonic()
                give_up = give_up or now + self.retry_s
                deadline = REQUEST_DEADLINE.get()
                if exc.code() != grpc.StatusCode.UNAVAILABLE or now + pause > min(give_up, deadline or give_up):
                    raise
                log.info("target unavailable; retrying", reason=exc.details(), pause_s=pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)

    async def _exchange(self, sequence_id: str, request: pb.VerifyRequest) -> pb.VerifyResponse:
        """One Verify on the sequence's open VerifySession stream (opened on first use). The stream
        has no deadline of its own, since it lives as long as the sequence; each exchange gets the
        timeout a unary call would have had, and fails the same way. Any failure, cancellation
        included, closes the stream: a response still on its way would answer the wrong request."""
        timeout = call_timeout(self.timeout_s)
        call = self._sessions.get(sequence_id)
        if call is None:
            call = self._sessions[sequence_id] = self.stub.VerifySession(metadata=_metadata())
        try:
            async with asyncio.timeout(timeout):
                await call.write(pb.VerifySessionRequest(verify=request))
                response = await call.read()
        except BaseException as exc:
            self._close_session(sequence_id)
            if isinstance(exc, TimeoutError):
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           f"Verify took longer than {timeout:.1f} s") from exc
            if isinstance(exc, asyncio.InvalidStateError):  # written to a stream that had already ended
                raise await self._ended(call) from exc
            raise
        if response is grpc.aio.EOF:
            self._close_session(sequence_id)
            raise await self._ended(call)
        return response.verify

    @staticmethod
    async def _ended(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
        code = await call.code()
        if code == grpc.StatusCode.OK:  # the target closed the stream without an error: treat as gone
            code = grpc.StatusCode.UNAVAILABLE
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details())

    def _close_session(self, sequence_id: str) -> None:
        call = self._sessions.pop(sequence_id, None)
        if call is not None:
            call.cancel()

    async def release(self, sequence_id: str) -> None:
        self._close_session(sequence_id)
        await self.stub.Release(pb.TargetServiceReleaseRequest(sequence_id=sequence_id), timeout=RELEASE_TIMEOUT_S, metadata=_metadata())

    async def close(self) -> None:
        for sequence_id in list(self._sessions):
            self._close_session(sequence_id)
        await self.channel.close()


class DraftClient:
    def __init__(self, address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.channel = open_channel(address, credentials)
        self.stub = pb_grpc.DraftServiceStub(self.channel)
        self.timeout_s = timeout_s

    async def info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        response = await self.stub.GetInfo(pb.DraftServiceGetInfoRequest(), timeout=timeout_s or self.timeout_s, wait_for_ready=True)
        return response.info

    async def propose(self, sequence_id: str, known_len: int, append: list[int], max_tokens: int,
                      min_cumulative_prob: float, temperature: float, seed: int,
                      progress: Progress | None = None, features: FeatureRows | None = None) -> DraftOutcome:
        request = pb.ProposeRequest(sequence_id=sequence_id, known_len=known_len, append_tokens=append, max_tokens=max_tokens,
                                    min_cumulative_prob=min_cumulative_prob, temperature=temperature, seed=seed)
        if features is not None:
            request.features.CopyFrom(pb.Features(start=features.start, rows=features.rows, dim=int(features.values.shape[1]),
                                                  data=features.to_bytes()))
        tokens: list[int] = []
        dists: list[Dist] = []
        confidence: list[float] = []
        compute = 0.0
        size = request.ByteSize()
        start = time.perf_counter()
        try:
            async for message in self.stub.Propose(request, timeout=call_timeout(self.timeout_s), metadata=_metadata()):
                tokens.append(message.token_id)
                confidence.append(message.cumulative_prob)
                dists.append((list(message.dist.token_ids), list(message.dist.probs)) if message.dist.token_ids else None)
                compute = message.compute_seconds
                size += message.ByteSize()
                if progress is not None:
                    progress.arrived(message.token_id)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise SequenceNotFound(sequence_id, exc.details() or "") from exc
            raise
        wall = time.perf_counter() - start
        return DraftOutcome(tokens, dists, compute, wall, size, confidence=confidence)

    async def propose_tree(self, sequence_id: str, known_len: int, append: list[int], tree: TreeSpec,
                           max_depth: int, temperature: float, seed: int) -> DraftOutcome:
        request = pb.ProposeTreeRequest(sequence_id=sequence_id, known_len=known_len, append_tokens=append,
                                        tree=pb.TreeParams(budget=tree.budget, top_k=tree.top_k, shape=tree.shape, max_depth=max_depth),
                                        temperature=temperature, seed=seed)
        start = time.perf_counter()
        try:
            response = await self.stub.ProposeTree(request, timeout=call_timeout(self.timeout_s), metadata=_metadata())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise SequenceNotFound(sequence_id, exc.details() or "") from exc
            raise
        wall = time.perf_counter() - start
        tree_pb = response.tree
        dists: list[Dist] = [(list(d.token_ids), list(d.probs)) if d.token_ids else None for d in tree_pb.child_dists]
        return DraftOutcome(list(tree_pb.tokens), dists, response.compute_seconds, wall,
                            request.ByteSize() + response.ByteSize(), parents=list(tree_pb.parents))

    async def release(self, sequence_id: str) -> None:
        await self.stub.Release(pb.DraftServiceReleaseRequest(sequence_id=sequence_id), timeout=RELEASE_TIMEOUT_S, metadata=_metadata())

    async def close(self) -> None:
        await self.channel.close()
