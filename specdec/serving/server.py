"""A specdec gRPC server's life: health, reflection, a draining shutdown on SIGTERM, its event loop,
and its heap settled once serving.

Every service's process runs one `Server`; `Drain` counts its calls and refuses new ones once
shutdown starts, so load balancers move on before requests are cut. Apart from rpc.py (what each
call goes through) because this is the server around the calls, not the calls.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import signal
from collections.abc import Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.serving.backend_auth import RequireToken, cleaned
from specdec.serving.rpc import CHANNEL_OPTIONS, KEEPALIVE_OPTIONS

log = structlog.get_logger(__name__)


# A connection closed for its age keeps its calls this long: a sequence's session stream lives as long
# as its generation, and is cut (then re-opened by the coordinator) only past this.
CONNECTION_AGE_GRACE_S = 3600.0

CLEANUP_S = 5.0  # after the grace period, how long cancelled calls get to release what they hold

# Always answered, also while draining: probes must see NOT_SERVING, not a refused connection.
OPEN_METHODS = ("/grpc.health.", "/grpc.reflection.")
# Streams that carry many sequences for a client's whole life (the target's Decode): refusing their
# next message would cut every sequence on them, so they see the drain themselves (Drain.listeners)
# and end once their work is done.
LASTING_METHODS = ("/specdec.v1.TargetService/Decode", "/specdec.v1.DraftService/Drafts")


class Drain(grpc.aio.ServerInterceptor):
    """Counts the service's calls in flight and, once `draining`, refuses new ones with UNAVAILABLE
    (the code clients retry on, on another replica). Health and reflection are neither counted nor
    refused, so the server keeps answering probes while in-flight calls finish."""

    def __init__(self):
        self.draining = False
        self.listeners: list = []  # called once draining starts (LASTING_METHODS' servicers)
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream is not None:
            lasting = details.method.startswith(LASTING_METHODS)
            return grpc.stream_stream_rpc_method_handler(
                (self._stream if lasting else self._session)(handler.stream_stream), handler.request_deserializer,
                handler.response_serializer
            )
        return handler  # client-streaming methods: none in specdec.v1

    def _unary(self, behaviour):
        async def counted(request, context):
            await self._enter(context)
            try:
                return await behaviour(request, context)
            finally:
                self._leave()

        return counted

    def _stream(self, behaviour):
        if not inspect.isasyncgenfunction(behaviour):  # a handler that writes with context.write and returns
            return self._unary(behaviour)

        async def counted(request, context):
            await self._enter(context)
            try:
                async for item in behaviour(request, context):
                    yield item
            finally:
                self._leave()

        return counted

    def _session(self, behaviour):
        """A bidirectional session is one call for its whole life; once draining, its next request
        is refused like a new call, so a draining server does not wait on sessions to end."""
        async def counted(requests, context):
            await self._enter(context)
            try:
                async for item in behaviour(self._until_draining(requests, context), context):
                    yield item
            finally:
                self._leave()

        return counted

    async def _until_draining(self, requests, context):
        async for request in requests:
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
            yield request

    async def _enter(self, context) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no call is in flight; False if `timeout` seconds pass first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(timeout, 0.0))
            return True
        except TimeoutError:
            return False


class Server:
    """A grpc.aio server with health checking, reflection and a graceful SIGTERM.

    Health reports NOT_SERVING until `mark_serving()` (called once the model is loaded and warmed),
    and again as soon as shutdown starts, so load balancers stop routing before requests are cut.
    Shutdown then drains: new calls are refused with UNAVAILABLE while health keeps answering, calls
    in flight get up to `grace` seconds to finish, and the server stops as soon as they have.
    """

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Iterable[str],
        max_concurrent_rpcs: int | None = None,
        interceptors=(),
        credentials: grpc.ServerCredentials | None = None,
        max_connection_age_s: float = 0.0,
        token: str = "",
    ):
        """`token`: the backend token every call but health checks must carry (specdec/serving/backend_auth.py);
        empty: none."""
        self.drain = Drain()
        # A port taken by another server is an error, not shared: gRPC binds with SO_REUSEPORT by
        # default, and two services (or two fleet replicas handed one free port) then split one
        # address's connections silently (specdec_tools/children.free_port).
        options = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS]
        if max_connection_age_s > 0:  # a GOAWAY makes the client re-resolve its target and reconnect
            options += [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
                        ("grpc.max_connection_age_grace_ms", int(CONNECTION_AGE_GRACE_S * 1000))]
        # The token is checked first: a call without it is refused before anything else sees it.
        auth = [RequireToken(token)] if cleaned(token) else []
        if auth:
            log.info("backend token required on every call but health checks")
        self.server = grpc.aio.server(
            options=options, maximum_concurrent_rpcs=max_concurrent_rpcs, interceptors=[*auth, self.drain, *interceptors]
        )
        self.http = None  # an HTTP server to stop with this one (the coordinator's API)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        address = f"{host}:{port}"
        try:
            self.port = self.server.add_secure_port(address, credentials) if credentials else self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc.aio raises where grpc returned 0
            raise OSError(f"cannot bind {address}: is another server on that port? ({exc})") from exc
        if self.port == 0:
            raise OSError(f"cannot bind {address}: is another server on that port?")
        self._stopped = asyncio.Event()
        self._stopping = False

    async def start(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def mark_serving(self) -> None:
        if _OWN_PROCESS:
            settle_heap()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def set_ready(self, name: str, ready: bool) -> None:
        """SERVING or NOT_SERVING for one service name while the server runs (the coordinator's, as
        its target comes and goes). Ignored once shutdown started: a draining server stays NOT_SERVING."""
        if self._stopping:
            return
        result = self.health.set(name, health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING)
        if inspect.isawaitable(result):
            await result

    async def _set_all(self, status) -> None:
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if inspect.isawaitable(result):
                await result

    async def loading(self, awaitable):
        """Awaits a start-up step (loading a model or a tokenizer, connecting to backends). If it
        fails, the server, already bound, stops at once before the error goes up: a bad --model
        ends the process with its message rather than a server left behind."""
        try:
            return await awaitable
        except BaseException:
            await self.server.stop(0)
            if self.http is not None:
                await self.http.stop()
            raise

    async def stop(self, grace: float) -> None:
        """Drains (see the class), then stops. A second call while draining stops at once."""
        if self._stopping:
            await self.server.stop(0)
            return
        self._stopping = True
        self.drain.draining = True
        for listener in self.drain.listeners:
            listener()
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        started = asyncio.get_running_loop().time()
        drained = await self.drain.wait_idle(grace)
        left = max(0.0, grace - (asyncio.get_running_loop().time() - started))
        log.info("draining done" if drained else "grace period over; cancelling calls in flight", in_flight=self.drain.in_flight)
        await self.server.stop(left)
        # Calls cut at the end of the grace period unwind now; give their cleanup (the coordinator
        # releasing their sequences in the backends) a moment before the event loop goes away.
        await self.drain.wait_idle(CLEANUP_S)
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


# Whether mark_serving() settles the heap: set by own_process(), which `specdec serve` calls before
# its service starts; a service started inside another process (tests, in-process stacks) leaves
# that process's heap alone, since objects frozen there would never be collected after it stops.
_OWN_PROCESS = False


def own_process() -> None:
    """Declares that this process is the service's own: it settles its heap once serving."""
    global _OWN_PROCESS
    _OWN_PROCESS = True


def settle_heap() -> int:
    """Collects what start-up left, then freezes every object still alive into the garbage
    collector's permanent generation; returns how many.

    Why: a loaded model leaves ~400,000 tracked objects (SmolLM2-135M packed as gguf-a8), and each
    full collection walks all of them: a stall of the event loop or the compute thread, longer
    than a decode step on a small CPU, whenever the collector decides it is due (then a
    token-to-token latency spike for every stream). They live as long as the process, so the
    collector has nothing to find among them; frozen, they are skipped and a full collection
    costs next to nothing (`benchmarks/gc_pause.py`; benchmarks/results/notebook-2026-11/NOTES.md,
    "A full garbage collection in a serving process"). Requests' own garbage is collected as before.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap settled", frozen_objects=frozen)
    return frozen


def run_service(main, event_loop: str = "uvloop"):
    """Runs a service's main coroutine to completion on its event loop (`--event-loop`).

    uvloop by default: every step crosses several event loops (the coordinator's, the draft's,
    the target's), each woken per message, and libuv's loop costs less per wake-up than the
    standard library's: a grpc.aio ping-pong on an open stream measured faster with it, and an
    n-gram step through the three services no slower. Where uvloop is not installed (Windows),
    asyncio's loop runs.
    """
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed; running on asyncio's event loop")
        else:
            return uvloop.run(main)
    return asyncio.run(main)


