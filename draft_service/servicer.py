"""gRPC servicer for the draft: streams proposals as they are drafted, model work off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import grpc
import structlog

from draft_service.batcher import DraftBatcher
from draft_service import loading
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.serving import metrics
from specdec.serving import tls
from specdec.serving.carriers import Carriers
from specdec.serving.wire import propose_call_from_proto
from specdec.calls.request import ProposeCall
from specdec.maths.sampling import check_temperature
from specdec.errors import SpecdecError
from specdec.serving.engine_host import EngineHost
from specdec.serving.rpc import rpc_method
from specdec.serving.server import Server

log = structlog.get_logger(__name__)
_DONE = object()


class _SequenceLock:
    def __init__(self):
        self.lock = asyncio.Lock()
        self.users = 0  # calls holding or waiting for it; the entry goes when none is left


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, batch_window_ms: float = 2.0, max_batch_size: int = 16, max_batch_tokens: int = 256):
        self.host = EngineHost("draft")
        self.batcher = DraftBatcher(self.host.run, self._forward_rows, batch_window_ms / 1000, max_batch_size, max_batch_tokens)
        self._busy: dict[str, _SequenceLock] = {}  # per sequence: one Propose at a time
        self.carriers = Carriers(self._release)  # a ProposeSession's sequences, freed when a coordinator is gone

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, sequence_id: str):
        """Serialises the calls on one sequence. A coordinator that drafts ahead (overlapped
        speculation) cancels a Propose and at once sends the next for the same sequence; the
        cancelled handler must be gone before the new one rolls the sequence back, or its last
        drafted token could land on top of the new call's tokens."""
        entry = self._busy.setdefault(sequence_id, _SequenceLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._busy[sequence_id]

    def _forward_rows(self, seqs):
        return self.engine.forward_rows(seqs)

    @property
    def engine(self) -> DraftEngine:
        return self.host.engine

    @rpc_method
    async def GetInfo(self, request, context):
        self.engine  # noqa: B018 - raises UNAVAILABLE while loading
        return pb.DraftServiceGetInfoResponse(info=self.host.info)

    @rpc_method
    async def Propose(self, request: pb.ProposeRequest, context):
        self.carriers.forget(request.sequence_id)  # drafted by calls now, not by a stream that may have ended
        async with contextlib.aclosing(self._propose(request)) as messages:  # a cancelled stream ends it at once
            async for message in messages:
                yield message

    @rpc_method
    async def ProposeSession(self, requests, context):
        carried: set[str] = set()
        try:
            async for request in requests:
                self.carriers.carry(request.propose.sequence_id, context)
                carried.add(request.propose.sequence_id)
                spent: list[float] = []
                tokens = [message async for message in self._propose(request.propose, spent)]
                yield pb.ProposeSessionResponse(tokens=tokens, compute_seconds=spent[0])
        finally:
            self.carriers.ended(context, carried)

    async def _propose(self, request: pb.ProposeRequest, spent: list[float] | None = None):
        """The Propose messages. `spent` receives the draft's seconds for the whole call: each
        message's compute_seconds is the time up to its own token, so none covers a chain's last
        forward when that forward's token fell under the threshold and was not sent."""
        spent = [] if spent is None else spent
        check_temperature(request.temperature)  # before the batched path too, which looks at it (engine.batches)
        call = propose_call_from_proto(request)
        async with self._one_at_a_time(call.sequence_id):
            if self.batcher.max_batch_size > 1 and self.engine.batches(call):
                proposals = self._propose_batched(call, spent)
            else:
                proposals = self._propose_alone(call, spent)
            m = metrics.draft()
            async for proposal in proposals:
                m.proposed_tokens.inc()
                message = pb.ProposeResponse(
                    token_id=proposal.token,
                    cumulative_prob=proposal.cumulative_prob,
                    compute_seconds=proposal.compute_seconds,
                )
                ids, probs = proposal.dist
                if ids:  # a chosen token sends no dist at all
                    message.dist.token_ids.extend(ids)
                    message.dist.probs.extend(probs)
                yield message
            m.propose_seconds.observe(spent[0])

    async def _propose_alone(self, call: ProposeCall, spent: list[float]):
        """The drafter's own loop runs on the worker thread and hands each token to the event loop the
        moment it exists, without waiting for it to be sent: one thread hop per token instead of a
        round trip per token. The round trips (the loop asking the worker for the next token) cost
        each as much as the n-gram drafter's whole proposal, and a model
        draft now drafts its next token while the last one is on the wire.

        The handler (and so the sequence's lock) ends only once the worker is done with the
        sequence, also when the client cancels the stream: the worker stops after its current token.

        An n-gram draft with a short catch-up is the exception (DraftEngine.answers_inline): with
        the worker idle it is answered right here, since two thread hops cost more than drafting.
        """
        def draft():
            return self.engine.propose(call)

        if self.host.idle and self.engine.answers_inline(len(call.append)):
            # Drafted whole before the first yield: the messages' sends may let other calls run,
            # and those must find the worker's engine as this call left it.
            started = time.perf_counter()
            proposals = list(draft())
            spent.append(time.perf_counter() - started)
            for proposal in proposals:
                yield proposal
            return
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def produce() -> float:
            started = time.perf_counter()
            for proposal in draft():
                loop.call_soon_threadsafe(ready.put_nowait, proposal)
                if stop.is_set():
                    break
            return time.perf_counter() - started

        worker = asyncio.ensure_future(self.host.run(produce))
        # Scheduled by the worker after its last token, so it arrives after them.
        worker.add_done_callback(lambda _: ready.put_nowait(_DONE))
        try:
            while (proposal := await ready.get()) is not _DONE:
                yield proposal
            spent.append(await worker)  # the call's seconds; raises the drafter's error, if it failed
        finally:
            stop.set()
            await asyncio.wait([worker])

    async def _propose_batched(self, call: ProposeCall, spent: list[float]):
        """The same chain, its forwards shared with the other streams drafting at the same time
        (draft_service/batcher.py); the token choices are the drafter's own (ModelDrafter.choose)."""
        start = time.perf_counter()
        seq = await self.host.run(self.engine.open, call)
        drafter = self.engine.drafter
        state = drafter.begin(call, start)
        self.batcher.opened()
        try:
            while not state.done:
                logits = await self.batcher.logits(seq)
                proposal = drafter.choose(logits, state)
                if proposal is None:
                    break
                seq.tokens.append(proposal.token)
                yield proposal
            spent.append(time.perf_counter() - start)
        finally:
            self.batcher.closed()

    @rpc_method
    async def ProposeTree(self, request: pb.ProposeTreeRequest, context):
        call = propose_call_from_proto(request)
        self.carriers.forget(call.sequence_id)
        self.engine  # noqa: B018 - raises UNAVAILABLE while loading
        async with self._one_at_a_time(call.sequence_id):
            tree = await self.host.run(self.engine.propose_tree, call)
        m = metrics.draft()
        m.proposed_tokens.inc(len(tree.tokens))
        m.propose_seconds.observe(tree.compute_seconds)
        response = pb.ProposeTreeResponse(compute_seconds=tree.compute_seconds)
        response.tree.parents.extend(tree.parents)
        response.tree.tokens.extend(tree.tokens)
        for ids, probs in tree.child_dists:
            response.tree.child_dists.add(token_ids=ids, probs=probs)
        return response

    @rpc_method
    async def Drafts(self, requests, context):
        """A target's one stream for the proposals of all its drafted runs (target_service/drafts.py):
        each ProposeRequest is answered as ProposeSession would answer it, concurrently with the
        others (so the batcher drafts them in shared forwards), and the answers finished by the time
        the event loop comes round go out in one message. When the stream ends (the target went
        away), the sequences it drafted are released."""
        self.engine  # noqa: B018 - raises UNAVAILABLE while loading
        ready = pb.DraftsResponse()
        wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        seen: set[str] = set()

        async def answer(request: pb.ProposeRequest) -> None:
            nonlocal ready
            entry = pb.DraftProposal(sequence_id=request.sequence_id)
            try:
                spent: list[float] = []
                tokens = [message async for message in self._propose(request, spent)]
                entry.proposal.CopyFrom(pb.ProposeSessionResponse(tokens=tokens, compute_seconds=spent[0]))
            except SpecdecError as exc:
                entry.error_code, entry.error_message = exc.code.value[0], str(exc)
            except Exception as exc:  # noqa: BLE001 - a bug fails its proposal, not the stream
                log.exception("proposal failed", sequence_id=request.sequence_id)
                entry.error_code, entry.error_message = grpc.StatusCode.INTERNAL.value[0], f"internal error: {exc}"
            ready.proposals.append(entry)
            wake.set()

        async def read() -> None:
            try:
                async for request in requests:
                    for sequence_id in request.release:
                        seen.discard(sequence_id)
                        await self.host.run(self.engine.release, sequence_id)
                    for propose in request.propose:
                        seen.add(propose.sequence_id)
                        task = asyncio.get_running_loop().create_task(answer(propose))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
            finally:
                wake.set()

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                if ready.proposals:
                    message, ready = ready, pb.DraftsResponse()
                    yield message  # proposals may finish meanwhile: look again before deciding the stream is done
                    continue
                if reader.done() and not tasks:
                    if reader.exception() is not None:
                        raise reader.exception()
                    return
                await wake.wait()
                wake.clear()
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)
            for sequence_id in seen:  # the target went away: its runs' drafts are of no use
                try:
                    await self.host.run(self.engine.release, sequence_id)
                except Exception:  # noqa: BLE001 - the idle timeout frees it eventually
                    log.warning("release failed", sequence_id=sequence_id)

    @rpc_method
    async def Release(self, request, context):
        return pb.DraftServiceReleaseResponse(released=await self._release(request.sequence_id))

    async def _release(self, sequence_id: str) -> bool:
        self.carriers.forget(sequence_id)
        return await self.host.run(self.engine.release, sequence_id)


def load_engine_with_model_info(config: DraftConfig) -> tuple[DraftEngine, pb.ModelInfo]:
    """The engine the config names (draft_service/loading.py) and its ModelInfo, as GetInfo sends it
    (blocking: call it off the event loop)."""
    engine, info = loading.load_engine(config)
    return engine, pb.ModelInfo(**dataclasses.asdict(info))


async def serve(config: DraftConfig, ready: asyncio.Future | None = None, signals: bool = True) -> None:
    """Binds at once (health NOT_SERVING), loads and warms the drafter, then reports SERVING."""
    servicer = DraftServicer(config.batch_window_ms, config.max_batch_size, config.max_batch_tokens)
    credentials = tls.server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
    server = Server(config.host, config.port, [pb.DESCRIPTOR.services_by_name["DraftService"].full_name], credentials=credentials,
                    max_connection_age_s=config.max_connection_age_s, token=config.backend_token)
    metrics.draft()
    metrics_port = metrics.serve_http(config.metrics_port, config.host)
    pb_grpc.add_DraftServiceServicer_to_server(servicer, server.server)
    await server.start()
    if signals:
        server.install_signal_handlers(config.grace_s)
    log.info("draft listening", port=server.port, drafter=config.drafter, model=config.model, metrics_port=metrics_port)
    engine, info = await server.loading(servicer.host.run(load_engine_with_model_info, config))
    engine.store.on_start = metrics.draft().sequences_started.inc
    metrics.follow_store(engine.store, metrics.draft().sequences, metrics.draft().kv_usage)
    servicer.host.attach(engine, info)
    await server.mark_serving()
    log.info("draft serving", port=server.port)
    server.servicer = servicer  # lets tests and tools inspect the engine behind the server
    if ready is not None:
        ready.set_result(server)
    sweep = servicer.host.sweep_idle(engine.store)  # frees what a vanished coordinator left, with no call to trigger it
    try:
        await server.wait()
    finally:
        if sweep is not None:
            sweep.cancel()
        servicer.batcher.close()
