"""What every specdec gRPC server shares: error mapping, request ids, health, reflection, shutdown.

Servicers stay thin: they translate protobuf to engine calls, and `rpc_method` turns the engines'
exceptions into precise status codes here, in one place (INTERNAL only for real bugs, logged).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import signal
import uuid
from collections.abc import Callable, Iterable

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from specdec.errors import InvalidArgument, SpecdecError, Unavailable
from specdec.logs import REQUEST_ID_METADATA, bind_request

log = structlog.get_logger(__name__)

# Messages carry token ids and sparse distributions; 64 MiB bounds a long prompt with room to spare.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def request_id_from(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA and value:
            return str(value)
    return uuid.uuid4().hex[:16]


def error_status(exc: SpecdecError) -> status_pb2.Status:
    """A google.rpc.Status with a BadRequest detail naming the field, for invalid arguments."""
    status = status_pb2.Status(code=exc.code.value[0], message=str(exc))
    if isinstance(exc, InvalidArgument):
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)
        ]))
        status.details.append(detail)
    return status


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, SpecdecError):
        if exc.code == grpc.StatusCode.INTERNAL:
            log.exception("internal error")
        await context.abort_with_status(rpc_status.to_status(error_status(exc)))
    log.exception("unexpected error")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def rpc_method(method: Callable) -> Callable:
    """Wraps a unary or server-streaming servicer method: binds the request id, maps errors."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def streaming(self, request, context):
            bind_request(request_id_from(context), rpc=method.__name__)
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status code, never swallowed
                await _abort(context, exc)

        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        bind_request(request_id_from(context), rpc=method.__name__)
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    return unary


class Server:
    """A grpc.aio server with health checking, reflection and a graceful SIGTERM.

    Health reports NOT_SERVING until `mark_serving()` (called once the model is loaded and warmed),
    and again as soon as shutdown starts, so load balancers stop routing before requests are cut.
    """

    def __init__(self, host: str, port: int, service_names: Iterable[str], max_concurrent_rpcs: int | None = None,
                 interceptors=(), credentials: grpc.ServerCredentials | None = None):
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS, maximum_concurrent_rpcs=max_concurrent_rpcs, interceptors=list(interceptors))
        self.http = None  # an HTTP server to stop with this one (the coordinator's API)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        address = f"{host}:{port}"
        self.port = self.server.add_secure_port(address, credentials) if credentials else self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def mark_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def _set_all(self, status) -> None:
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if inspect.isawaitable(result):
                await result

    async def stop(self, grace: float) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)
        if self.http is not None:
            await self.http.stop()
        self._stopped.set()

    def install_signal_handlers(self, grace: float) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop(grace)))

    async def wait(self) -> None:
        await self._stopped.wait()
        await self.server.wait_for_termination()


class EngineHost:
    """What the draft and target servicers share: an engine that arrives after the server starts,
    and one worker thread that runs every model call in arrival order, off the event loop.

    The servicer is registered before the server starts (gRPC wants handlers first), so until
    `attach` it answers UNAVAILABLE while health says NOT_SERVING.
    """

    def __init__(self, role: str):
        self.role = role
        self._engine = None
        self.info = None
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=role)

    def attach(self, engine, info) -> None:
        self.info = info
        self._engine = engine

    @property
    def engine(self):
        if self._engine is None:
            raise Unavailable(f"the {self.role} model is still loading")
        return self._engine

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
