"""What every specdec gRPC call goes through: error mapping, request ids, requests parsed here, channel
options. The server around the calls is server.py; the engine's worker thread, engine_host.py.

Servicers stay thin: they translate protobuf to engine calls, and `rpc_method` turns the engines'
exceptions into precise status codes here, in one place (INTERNAL only for real bugs, logged).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from collections.abc import Callable

import grpc
import structlog
from google.protobuf import any_pb2, message_factory
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from specdec.errors import InvalidArgument, SpecdecError
from specdec.serving.logs import REQUEST_ID_METADATA, bind_request

log = structlog.get_logger(__name__)

# Messages carry token ids and sparse distributions; 64 MiB bounds a long prompt with room to spare.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# The server pings a quiet connection: a peer whose host vanished (no reset ever comes) is found
# within half a minute, its streams end, and the sequences they carried are freed
# (specdec/serving/carriers.py). The ack timeout is generous because a peer on a saturated box may
# answer late, and a false alarm cuts every sequence on the connection.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
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
        detail.Pack(
            error_details_pb2.BadRequest(
                field_violations=[error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)]
            )
        )
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
    """Wraps a unary or streaming (server or bidirectional) servicer method: binds the request id, maps errors."""
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


def add_parsing_servicer(servicer, server: grpc.aio.Server, service) -> None:
    """Registers `servicer`'s methods for `service` (a ServiceDescriptor) with requests handed over as
    bytes and parsed here. With the generated registration, gRPC parses them before any handler runs
    and answers UNKNOWN ("Unexpected DecodeError") to bytes that are not the message, or a string
    field that is not UTF-8; that is the client's mistake, so here it is INVALID_ARGUMENT naming
    `request`, mapped by `_abort` like every other error. Unary and server-streaming methods only:
    the public services have no others."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client streaming is not supported here")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behaviour = _parsed(getattr(servicer, method.name), request_cls, method.server_streaming)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(behaviour, request_deserializer=None, response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def parse_request(data: bytes, request_cls):
    """`data` as a `request_cls` message; InvalidArgument("request") when it is not one."""
    try:
        return request_cls.FromString(data)
    except DecodeError:
        raise InvalidArgument("request", f"cannot be parsed as a {request_cls.DESCRIPTOR.full_name} (malformed bytes, "
                                         "or a string field that is not valid UTF-8)") from None


def _parsed(behaviour: Callable, request_cls, streaming: bool) -> Callable:
    if streaming:
        async def stream(data, context):
            """A coroutine that writes: a method may be an async generator, or a coroutine that
            writes with context.write itself (to bound each write, as GenerateStream does)."""
            try:
                request = parse_request(data, request_cls)
            except InvalidArgument as exc:
                await _abort(context, exc)  # raises AbortError
            result = behaviour(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    await context.write(item)
            else:
                await result

        return stream

    async def unary(data, context):
        try:
            request = parse_request(data, request_cls)
        except InvalidArgument as exc:
            await _abort(context, exc)  # raises AbortError
        else:
            return await behaviour(request, context)

    return unary
