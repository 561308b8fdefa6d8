"""A coordinator's process: it binds at once (health NOT_SERVING), waits for its target and draft,
and serves the gRPC API (servicer.py) and the OpenAI-compatible one (http.py) until SIGTERM drains it.

Apart from servicer.py because assembling a process (backends, TLS, tokens, the HTTP server beside
the gRPC one) is another job than answering a request.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from coordinator.clients import DraftClient, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.releases import releases_done
from coordinator.readiness import BackendHealth
from coordinator.servicer import CoordinatorServicer
from coordinator.validate import bearer, token_matches
from protos import specdec_pb2 as pb
from specdec.serving import metrics
from specdec.serving import tls
from specdec.serving.rpc import add_parsing_servicer
from specdec.serving.server import CLEANUP_S, Server

log = structlog.get_logger(__name__)


async def _wait_for_info(client, deadline: float, role: str) -> pb.ModelInfo:
    """GetInfo answers UNAVAILABLE while the service loads its model: keep asking until the deadline.
    A refused token ends the wait at once: it will not change while the coordinator waits."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await client.info(timeout_s=max(1.0, deadline - loop.time()))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ValueError(f"the {role} at {client.address} refused this coordinator's calls ({exc.details()}): "
                                 "--backend-token must be the same on the coordinator, the draft and the target") from None
            if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() > deadline:
                raise
            log.info("waiting for a backend", address=client.address, reason=exc.details())
            await asyncio.sleep(1.0)


IN_PROCESS_NGRAM = "ngram"  # --draft ngram: prompt lookup in the coordinator, no draft service


def in_process_ngram():
    """The n-gram drafter inside the coordinator: a lookup costs far less than a Propose round trip
    to a draft service, even on loopback, so for prompt lookup the hop is most of the cost. Also
    one service fewer to deploy where prompt lookup is all one wants (RAG, summaries, code edits)."""
    from coordinator.local import LocalProposer
    from draft_service.config import DraftConfig
    from draft_service.servicer import load_engine_with_model_info

    engine, info = load_engine_with_model_info(DraftConfig(drafter="ngram"))  # what `specdec serve draft --drafter ngram` runs
    return LocalProposer(engine), info


async def connect_backends(config: CoordinatorConfig):
    """Waits (up to startup_timeout_s) for the target and the draft, and checks they fit together."""
    deadline = asyncio.get_running_loop().time() + config.startup_timeout_s
    credentials = tls.channel_credentials(config.backend_tls_ca, config.backend_tls_cert, config.backend_tls_key)
    if config.backend_token.strip():
        log.info("calls to the target and the draft carry the backend token")
    target = TargetClient(config.target, config.rpc_timeout_s, credentials, retry_s=config.target_retry_s, token=config.backend_token)
    target_info = await _wait_for_info(target, deadline, "target")
    draft = draft_info = None
    if config.draft == IN_PROCESS_NGRAM:
        draft, draft_info = in_process_ngram()
    elif config.draft:
        draft = DraftClient(config.draft, config.rpc_timeout_s, credentials, token=config.backend_token)
        draft_info = await _wait_for_info(draft, deadline, "draft")
        if draft_info.vocab_size and draft_info.vocab_size != target_info.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft_info.vocab_size}) differs from the target's ({target_info.vocab_size})")
    return target, target_info, draft, draft_info


async def serve(config: CoordinatorConfig, ready: asyncio.Future | None = None, signals: bool = True, tokenizer=None) -> None:
    """Binds at once (health NOT_SERVING); SERVING once the tokenizer and both backends are ready."""
    servicer = CoordinatorServicer(config)
    service_name = pb.DESCRIPTOR.services_by_name["CoordinatorService"].full_name
    interceptors = [TokenAuth(config.api_token, service_name)] if config.api_token else []
    credentials = tls.server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
    server = Server(config.host, config.port, [service_name], interceptors=interceptors, credentials=credentials)
    add_parsing_servicer(servicer, server.server, pb.DESCRIPTOR.services_by_name["CoordinatorService"])
    servicer.drain = server.drain  # the HTTP API answers 503 while the gRPC server drains
    await server.start()
    metrics.coordinator()
    http = await start_http(servicer, config) if config.http_port >= 0 else None
    server.http = http
    if signals:
        server.install_signal_handlers(config.grace_s)
    log.info("coordinator listening", port=server.port, http_port=http.port if http else None,
             target=config.target, draft=config.draft or None)
    if tokenizer is None:
        from specdec.model.loading import load_tokenizer

        tokenizer = await server.loading(asyncio.to_thread(load_tokenizer, config.tokenizer))
    target, target_info, draft, draft_info = await server.loading(connect_backends(config))
    servicer.attach(tokenizer, target, target_info, draft, draft_info)
    await server.mark_serving()
    log.info("coordinator serving", port=server.port, target_model=target_info.model,
             drafter=(draft_info.drafter or draft_info.model) if draft_info else None)
    servicer.backends = BackendHealth(target.channel, draft.channel if isinstance(draft, DraftClient) else None,
                                      on_target=lambda up: server.set_ready(service_name, up))
    watch = asyncio.create_task(servicer.backends.watch())
    server.servicer = servicer  # lets tests and tools inspect the engine behind the server
    if ready is not None:
        ready.set_result(server)
    try:
        await server.wait()
    finally:
        watch.cancel()
    await releases_done(CLEANUP_S)  # handlers cut twice leave their releases running on their own


class HttpServer:
    """uvicorn inside the coordinator's event loop, beside the gRPC server."""

    def __init__(self, server, task):
        self.server, self.task = server, task

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http(servicer: CoordinatorServicer, config: CoordinatorConfig) -> HttpServer:
    import uvicorn

    from coordinator.http import build_app
    from coordinator.http_protocol import guarded_protocol

    app = build_app(servicer, model_names=config.model_names(), api_token=config.api_token, max_body_bytes=config.max_body_bytes)
    protocol = guarded_protocol(config.http_header_timeout_s, config.max_connections_per_client)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.http_port, log_level="warning", lifespan="off",
                                           http=protocol,  # slowloris guards (coordinator/http_protocol.py)
                                           log_config=None))  # uvicorn's own handlers would bypass the one log stream (logs.py)
    server.install_signal_handlers = lambda: None  # the gRPC server owns SIGTERM
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the bind error
        await asyncio.sleep(0.01)
    return HttpServer(server, task)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Bearer-token check on the public service; health and reflection stay open for probes."""

    def __init__(self, token: str, service: str):
        self.token, self.prefix = token, f"/{service}/"

    async def intercept_service(self, continuation, details):
        if not details.method.startswith(self.prefix):
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        streaming = details.method.endswith("Stream")
        if bearer(header) is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token in `authorization` metadata", streaming)
        if not token_matches(header, self.token):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "invalid bearer token", streaming)
        return await continuation(details)


def _deny(code: grpc.StatusCode, message: str, streaming: bool):
    """A handler that only aborts, of the same kind (unary or server streaming) as the method."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - never reached; makes this an async generator

    if streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
