"""The target's one stream to its draft service (`--draft`), for the proposals of its drafted runs.

A run that drafts with a model (target_service/runs.py) needs a proposal before each pass. Asked by
the coordinator, each step crossed the wire four times (coordinator -> draft -> coordinator ->
target -> coordinator); asked by the target, twice (target -> draft -> target), with the verdict of
the last step in the same message as the next ask (`known_len` rolls the draft back). Every run's
asks go on ONE DraftService.Drafts stream: the asks made in one turn of the event loop travel in
one DraftsRequest, and the draft answers in batched DraftsResponses, so 32 runs cost one message
each way a round, not 32.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import structlog

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.errors import SequenceNotFound, Unavailable
from specdec.serving.backend_auth import authorized
from specdec.serving.outbox import StreamClient
from specdec.serving.rpc import CHANNEL_OPTIONS
from specdec.serving.wire import propose_call_to_proto
from specdec.calls.request import ProposeCall

log = structlog.get_logger(__name__)

_NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


class DraftLink(StreamClient):
    """Propose over the Drafts stream; the stream opens on first use and again after it broke."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None, token: str = ""):
        """`token`: the backend token the Drafts stream carries (--backend-token); empty: none."""
        self.address = address
        options = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        self._channel = authorized(grpc.aio.secure_channel(address, credentials, options=options) if credentials is not None
                                   else grpc.aio.insecure_channel(address, options=options), token)
        self._stub = pb_grpc.DraftServiceStub(self._channel)
        super().__init__(self._stub.Drafts, pb.DraftsRequest, "Drafts")
        # Per sequence, the asks in flight in the order sent: the draft answers one sequence's asks
        # in that order (it serialises them), and a run drafting ahead has two in flight at once.
        self._waiting: dict[str, collections.deque[asyncio.Future]] = {}
        self.asks = 0  # ProposeRequests sent in them

    async def propose(self, call: ProposeCall, timeout: float) -> pb.ProposeSessionResponse:
        """The proposal for `call` (a chain), as a ProposeSession would answer it. Raises
        SequenceNotFound where the draft lost the sequence (ask again with known_len 0),
        Unavailable where the draft or the stream failed."""
        request = propose_call_to_proto(call)
        self._ensure()
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(request.sequence_id, collections.deque()).append(future)
        self._outbox.pending.propose.append(request)
        self.asks += 1
        self._outbox.changed()
        try:
            async with asyncio.timeout(timeout):
                entry = await asyncio.shield(future)  # a cancelled ask keeps its place: its answer still comes
        except TimeoutError as exc:
            raise Unavailable(f"the draft service took longer than {timeout:.3g} s") from exc
        if entry.error_code == _NOT_FOUND:
            raise SequenceNotFound(request.sequence_id, entry.error_message)
        if entry.error_code:
            raise Unavailable(f"the draft service failed: {entry.error_message}")
        return entry.proposal

    def release(self, sequence_id: str) -> None:
        """Frees the draft's copy of a sequence whose run ended (sent with the next message)."""
        if self._call is not None:
            self._outbox.pending.release.append(sequence_id)
            self._outbox.changed()

    async def _read(self, call) -> None:
        reason = "the draft service ended the stream"
        try:
            async for response in call:
                self.messages_in += 1
                for entry in response.proposals:
                    queue = self._waiting.get(entry.sequence_id)
                    if not queue:
                        continue
                    future = queue.popleft()
                    if not queue:
                        del self._waiting[entry.sequence_id]
                    if not future.done():
                        future.set_result(entry)
        except grpc.aio.AioRpcError as exc:
            reason = f"the drafts stream broke: {exc.code().name} {exc.details()}"
        finally:
            self._ended(call)
            waiting, self._waiting = self._waiting, {}
            for future in (f for queue in waiting.values() for f in queue):
                if not future.done():
                    future.set_exception(Unavailable(reason))
                    future.exception()  # retrieved: nobody may be waiting for it any more

    async def close(self) -> None:
        await super().close()
        await self._channel.close()
