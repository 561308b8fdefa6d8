"""gRPC servicer for the target: protobuf <-> TargetEngine, model work off the event loop."""

from __future__ import annotations

import asyncio
import functools

import structlog

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.serving import metrics
from specdec.serving import tls
from specdec.serving.carriers import Carriers
from specdec.serving.engine_host import EngineHost
from specdec.serving.rpc import rpc_method
from specdec.serving.server import Server
from specdec.serving.threads import loop_computes_alike
from specdec.serving.wire import verify_call_from_proto, verify_result_to_proto
from target_service.config import TargetConfig
from target_service.batcher import VerifyBatcher
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from target_service.runs import DecodeStreams

log = structlog.get_logger(__name__)

# A step's call feeds the target the token(s) it has not seen since its last step (the correction
# or bonus token) before its draft; more is a prompt, or a sequence re-sent whole.
INLINE_APPEND = 2


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, batch_window_ms: float = 2.0, max_batch_size: int = 16, max_batch_tokens: int = 256):
        # One worker: the model runs one forward at a time; Verify calls that wait together share it.
        self.host = EngineHost("target")
        self.batcher = VerifyBatcher(self.host.run, self._verify_batch, batch_window_ms / 1000, max_batch_size, max_batch_tokens,
                                     inline=self._inline, engine=lambda: self.engine, settles=True, joinable=self._joinable)
        self.runs = DecodeStreams(self.batcher.submit, self._release)
        self.carriers = Carriers(self._release)  # a VerifySession's sequences, freed when a coordinator is gone

    def _verify_batch(self, calls, decode_ahead: bool = True, settle=None, join=None):
        # read from the worker thread: a list's and a set's lengths, set on the loop's thread, are safe to read
        return self.engine.verify_batch(calls, decode_ahead, interrupt=self._interrupt, settle=settle,
                                        dropped=self.runs.dropped, join=join)

    @staticmethod
    def _joinable(call: VerifyCall) -> bool:
        """Whether a call that arrives during a pass is offered to it: no tree, no features (the engine
        has the last word, a prompt's length against its chunk budget among them: TargetEngine._joining)."""
        return call.tree is None and not call.return_features

    def _interrupt(self) -> bool:
        """Whether passes decoded ahead should stop: a Verify waits for the next pass, or other work
        waits for the worker. A run that ended or was cancelled stops only its own row (`dropped`)."""
        return self.batcher.waiting() or self.host.queued()

    def _inline(self, call: VerifyCall) -> bool:
        """Whether a lone call runs right on the event loop, without the hop to the worker thread
        and back, a sizeable share of a short step's exchange: a step's call (its catch-up is the
        last step's token, not a prompt or a lost sequence re-sent whole, which would hold the loop
        for long), with the worker idle, where this thread computes as fast as the worker."""
        # A run's call decodes ahead for the rest of its run, handing out tokens after each pass,
        # which the event loop must be free to send.
        return (len(call.append) <= INLINE_APPEND and not call.prefill and self.host.idle and self._loop_computes_alike
                and call.sequence_id not in self.runs.runs)

    @functools.cached_property
    def _loop_computes_alike(self) -> bool:
        return loop_computes_alike(self.engine.lm.device)  # asked once a call arrives, so the engine is there

    @property
    def engine(self) -> TargetEngine:
        return self.host.engine

    @rpc_method
    async def GetInfo(self, request, context):
        self.engine  # noqa: B018 - raises UNAVAILABLE while loading
        return pb.TargetServiceGetInfoResponse(info=self.host.info)

    @rpc_method
    async def Verify(self, request: pb.VerifyRequest, context):
        self.carriers.forget(request.sequence_id)  # stepped by calls now, not by a stream that may have ended
        response = pb.VerifyResponse()
        await self._verify(request, response)
        return response

    @rpc_method
    async def VerifySession(self, requests, context):
        carried: set[str] = set()
        try:
            async for request in requests:
                self.carriers.carry(request.verify.sequence_id, context)
                carried.add(request.verify.sequence_id)
                session = pb.VerifySessionResponse()
                await self._verify(request.verify, session.verify)  # written in place: no copy of the answer a step
                yield session
        finally:
            self.carriers.ended(context, carried)

    async def _verify(self, request: pb.VerifyRequest, response: pb.VerifyResponse) -> None:
        """Verifies `request` and writes the answer into `response`."""
        call = verify_call_from_proto(request)
        self.engine  # noqa: B018 - raises UNAVAILABLE while loading
        result = await self.batcher.submit(call)
        m = metrics.target()
        m.verify_seconds.observe(result.compute_seconds)
        m.batch_size.observe(result.batch_size)
        m.draft_tokens.inc(len(request.draft_tokens) + len(request.draft_tree.tokens) + result.ahead_drafted)
        m.accepted_tokens.inc(result.accepted + result.ahead_accepted)
        verify_result_to_proto(result, response)

    @rpc_method
    async def Decode(self, requests, context):
        self.engine  # noqa: B018 - raises UNAVAILABLE while loading
        async for response in self.runs.serve(requests, context):
            yield response

    @rpc_method
    async def Release(self, request, context):
        return pb.TargetServiceReleaseResponse(released=await self._release(request.sequence_id))

    async def _release(self, sequence_id: str) -> bool:
        self.carriers.forget(sequence_id)
        self.batcher.released(sequence_id)  # not expected in the next pass: it will not call again
        # in the background: the passes decoding ahead for the other sequences go on (EngineHost.queued)
        return await self.host.run(self.engine.release, sequence_id, background=True)


def _checked(lm) -> str | None:
    """row_exactness, or why it could not run: a model the check cannot drive is served, not refused,
    and claims nothing it was not seen to do."""
    from specdec.forward.selfcheck import row_exactness

    try:
        return row_exactness(lm)
    except Exception as exc:  # noqa: BLE001 - any failure of the check means: not shown exact
        return f"the check could not run ({type(exc).__name__}: {exc})"


def _knee(engine: TargetEngine) -> int:
    """engine.pass_knee, or 0 (not measured: coordinators then use 8) if the timing could not run:
    a budget is a load policy, never a reason not to serve."""
    try:
        return engine.pass_knee()
    except Exception as exc:  # noqa: BLE001 - any failure of the timing means: no knee reported
        log.warning("timing the pass-cost knee failed; reporting none", error=f"{type(exc).__name__}: {exc}")
        return 0


async def serve(config: TargetConfig, ready: asyncio.Future | None = None, signals: bool = True) -> None:
    """Binds at once (health NOT_SERVING), loads and warms the model, then reports SERVING.

    `ready` (tests, `specdec up` in-process) receives the Server once it is serving.
    """
    from specdec.model.assembly import LMOptions, load_lm

    servicer = TargetServicer(config.batch_window_ms, config.max_batch_size, config.max_batch_tokens)
    credentials = tls.server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
    server = Server(config.host, config.port, [pb.DESCRIPTOR.services_by_name["TargetService"].full_name], credentials=credentials,
                    max_connection_age_s=config.max_connection_age_s, token=config.backend_token)
    metrics.target()
    metrics_port = metrics.serve_http(config.metrics_port, config.host)
    pb_grpc.add_TargetServiceServicer_to_server(servicer, server.server)
    await server.start()
    if signals:
        server.install_signal_handlers(config.grace_s)
    log.info("target listening", port=server.port, model=config.model, metrics_port=metrics_port)
    options = LMOptions(model=config.model, device=config.device, dtype=config.dtype, weights=config.weights,
                        packed_gemm_rows=config.packed_gemm_rows, packed_gemm_min_rows=config.packed_gemm_min_rows,
                        numerics=config.numerics, pass_rows=config.pass_rows, static_slots=config.static_slots,
                        static_context=config.static_context)
    served = await server.loading(servicer.host.run(load_lm, options))  # on the compute thread
    loaded = served.loaded
    numerics = served.numerics
    if numerics == "exact":  # claimed only once checked on this device (specdec/forward/selfcheck.py)
        differs = await server.loading(servicer.host.run(_checked, served.lm))
        if differs:
            log.warning("numerics are not exact here: serving as 'fast'", reason=differs)
            numerics = "fast"
    engine = TargetEngine(served.lm, config.max_sequences, config.idle_timeout_s, config.max_prefill_tokens_per_pass)
    await server.loading(servicer.host.run(engine.warm_up))
    verify_knee = await server.loading(servicer.host.run(_knee, engine))
    info = pb.ModelInfo(
        model=config.model, vocab_size=engine.lm.vocab_size, max_context=engine.lm.max_context,
        eos_token_ids=engine.lm.eos_token_ids, device=str(loaded.device), dtype=str(loaded.dtype).removeprefix("torch."),
        weights=served.weights, weight_bytes=served.weight_bytes, draft=config.draft,
        prefill_chunk_tokens=config.max_prefill_tokens_per_pass, numerics=numerics, verify_knee=verify_knee,
    )
    engine.store.on_start = metrics.target().sequences_started.inc
    engine.on_tokens = servicer.runs.on_tokens
    if config.draft:
        from target_service.drafts import DraftLink

        servicer.runs.link = DraftLink(config.draft, tls.channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
                                       if config.tls_ca else None, token=config.backend_token)
    servicer.runs.draining = lambda: server.drain.draining
    server.drain.listeners.append(servicer.runs.drain)
    metrics.follow_store(engine.store, metrics.target().sequences, metrics.target().kv_usage)
    servicer.host.attach(engine, info)
    await server.mark_serving()
    log.info("target serving", port=server.port, vocab_size=engine.lm.vocab_size, weights=served.weights, numerics=numerics,
             verify_knee=verify_knee)
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
        if servicer.runs.link is not None:
            await servicer.runs.link.close()
