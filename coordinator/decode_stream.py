"""The coordinator's end of the target's Decode stream (target_service/runs.py): every run of this
coordinator multiplexed on ONE stream, started and cancelled in batched messages, their progress
read from batched answers and handed to each run's own queue.

Why one stream: a stream per sequence costs every request a call's set-up and the target a message
per sequence per pass; on one stream, whatever the number of runs, a pass costs one message each
way at most (`messages_in`, `messages_out` count them). A run needs nothing from the coordinator
between passes, so nothing is on its critical path but the target.

A fleet of target replicas gets a stream per run instead (`StreamPerRun`): gRPC's ring_hash routes
a call, not a message within a stream, to the replica holding its sequence. No exchange between
passes still, but a message per run per pass.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog

from coordinator.protocol import DecodeProgress, DecodeRun
from protos import specdec_pb2 as pb
from specdec.errors import SequenceNotFound
from specdec.serving.outbox import StreamClient
from specdec.serving.wire import logprobs_from_proto

log = structlog.get_logger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _went_away(exc: BaseException) -> bool:
    """The stream broke the way a target that restarts or drains breaks it (as target_went_away)."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    code = exc.code()
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or (
        code == grpc.StatusCode.UNKNOWN and (exc.details() or "").startswith("Stream removed"))


def run_proto(run: DecodeRun) -> pb.DecodeRun:
    s = run.sampling
    return pb.DecodeRun(sequence_id=run.sequence_id, known_len=0, append_tokens=run.append,
                        sampling=pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed),
                        max_new_tokens=run.max_new_tokens, stop_token_ids=sorted(run.stop_token_ids),
                        eos_banned_until=run.eos_banned_until, logprobs=run.logprobs,
                        lookup_max_tokens=run.lookup_draft_length, lookup_costs=run.lookup_costs, lookup_source=run.lookup_source,
                        draft_length=run.draft_length, adaptive=run.adaptive, seeded=run.seeded, features=run.features,
                        overlap=run.overlap, report_every=run.report_every)


class DecodeStream(StreamClient):
    """Implements coordinator.protocol.Decoder over a target's Decode method."""

    def __init__(self, open_stream, retry_s: float):
        """`open_stream()`: a new Decode call (the stub's method; no deadline, it lives as long as the
        coordinator). `retry_s`: how long the loop starts a run again while the target is away."""
        super().__init__(self._opened, pb.DecodeRequest, "Decode")
        self._open, self.retry_s = open_stream, retry_s
        self._runs: dict[str, asyncio.Queue] = {}
        self.opened = 0  # streams opened (one, unless the target went away)

    def _opened(self):
        self.opened += 1
        return self._open()

    async def decode(self, run: DecodeRun) -> AsyncIterator[DecodeProgress]:
        if run.sequence_id in self._runs:
            raise ValueError(f"sequence {run.sequence_id!r} already has a run")
        self._ensure()
        queue: asyncio.Queue = asyncio.Queue()
        self._runs[run.sequence_id] = queue
        start = run_proto(run)
        self._outbox.pending.start.append(start)
        self._outbox.changed()
        done, sent = False, start.ByteSize()
        try:
            while not done:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True  # the stream broke: the target stopped the run (or has gone)
                    raise item
                done = item.done
                if item.error_code:
                    raise self._error(run.sequence_id, item)
                yield DecodeProgress(list(item.tokens), logprobs_from_proto(item.logprobs), item.passes, item.drafted, item.accepted,
                                     predicted_drafted=item.prediction_drafted, predicted_accepted=item.prediction_accepted,
                                     compute_seconds=item.compute_seconds, done=item.done, wire_bytes=item.ByteSize() + sent)
                sent = 0
        finally:
            self._runs.pop(run.sequence_id, None)
            if not done and self._call is not None:  # closed early (a stop string, the client left): stop it
                self._outbox.pending.cancel.append(run.sequence_id)
                self._outbox.changed()

    @staticmethod
    def _error(sequence_id: str, item: pb.DecodeProgress) -> Exception:
        code = _CODES.get(item.error_code, grpc.StatusCode.UNKNOWN)
        if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
            return SequenceNotFound(sequence_id, item.error_message)
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), item.error_message)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error: BaseException | None = None
        try:
            async for response in call:
                self.messages_in += 1
                for progress in response.runs:
                    queue = self._runs.get(progress.sequence_id)
                    if queue is not None:
                        queue.put_nowait(progress)
            error = SequenceNotFound("*", "the target ended its Decode stream (it is shutting down)")
        except asyncio.CancelledError:
            error = SequenceNotFound("*", "the Decode stream was closed")
            raise
        except grpc.aio.AioRpcError as exc:
            error = SequenceNotFound("*", f"the Decode stream broke: {exc.details()}") if _went_away(exc) else exc
        finally:
            self._ended(call)
            for queue in list(self._runs.values()):
                queue.put_nowait(error)



class StreamPerRun:
    """A fleet's Decoder: each run on a Decode stream of its own, opened with its sequence's
    metadata (`open_stream(sequence_id)`) so the fleet's ring_hash takes it to one replica."""

    def __init__(self, open_stream, retry_s: float):
        self._open, self.retry_s = open_stream, retry_s

    async def decode(self, run: DecodeRun) -> AsyncIterator[DecodeProgress]:
        stream = DecodeStream(lambda: self._open(run.sequence_id), self.retry_s)
        try:
            async with contextlib.aclosing(stream.decode(run)) as progress:
                async for made in progress:
                    yield made
        finally:
            await stream.close()

    async def close(self) -> None:
        pass
