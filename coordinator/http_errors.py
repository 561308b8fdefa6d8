"""The HTTP API's refusals in OpenAI's envelope ({"error": {"message", "type", "param", "code"}}):
a SpecdecError as its status, a body past --max-body-bytes (refused before it is read) or not the
request model, and a client that left before its response was ready (its work cancelled at once).

Apart from http.py (the routes) because every route refuses alike, and the replies (http_replies.py)
end a stream with the same envelope.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from coordinator import openai_schema as schema
from coordinator.bodies import InvalidBody
from specdec.errors import InvalidArgument, Overloaded, SpecdecError, Unavailable

T = TypeVar("T")

# status, OpenAI's error type, and the code when the error has none of its own
KINDS: dict[type, tuple[int, str, str]] = {
    InvalidArgument: (400, "invalid_request_error", "invalid_value"),
    Overloaded: (429, "rate_limit_error", "rate_limit_exceeded"),
    Unavailable: (503, "service_unavailable_error", "service_unavailable"),
}


def error(status: int, message: str, kind: str, code: str, param: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def failed(exc: SpecdecError, headers: dict[str, str] | None = None) -> JSONResponse:
    status, kind, code = KINDS.get(type(exc), (500, "server_error", "internal_error"))
    headers = dict(headers or {})
    if isinstance(exc, (Overloaded, Unavailable)):  # when to come back, in whole seconds (RFC 9110)
        headers["Retry-After"] = str(max(1, math.ceil(getattr(exc, "retry_after_s", 1.0))))
    if isinstance(exc, InvalidArgument):
        param = schema.JSON_NAMES.get(exc.field, exc.field.split("[")[0])
        return error(status, f"{param}: {exc.description}", kind, exc.reason, param, headers)
    return error(status, str(exc), kind, code, headers=headers)


def _location(loc: tuple) -> str:
    """A pydantic error location as the request spells it: messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "function-after") or "[" in str(part):
            continue  # union branches and validators, not fields
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def _telling(errors: list[dict]) -> dict:
    """The error to report. Where a value fits no branch of a union (a prompt is text or token ids),
    pydantic lists every branch's complaint, the first branch's first: token id -5 read "prompt:
    Input should be a valid string". The branch whose type matched and whose constraint failed says
    what is wrong ("prompt[0]: Input should be greater than or equal to 0")."""
    return next((e for e in errors if not e["type"].endswith("_type")), errors[0])


def invalid_body(errors: list[dict]) -> JSONResponse:
    first = _telling(errors)
    if first["type"] == "json_invalid":
        return error(400, f"the body is not valid JSON: {first['msg']}", "invalid_request_error", "invalid_json", "body")
    param = _location(first["loc"])
    if first["type"] == "extra_forbidden":
        return error(400, f"Unrecognized request argument supplied: {param}", "invalid_request_error", "unknown_parameter", param)
    return error(400, f"{param}: {first['msg']}", "invalid_request_error", "invalid_value", param)


class BodyTooLarge(Exception):
    """The request body is past --max-body-bytes."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes (--max-body-bytes)")


async def read_body(raw: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes: refused from Content-Length before a byte is read, and for a
    chunked body as soon as the bytes received pass the limit, so memory stays bounded either way."""
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    try:
        async for chunk in raw.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def too_large(exc: BodyTooLarge, headers: dict[str, str] | None = None) -> JSONResponse:
    return error(413, str(exc), "invalid_request_error", "request_too_large", "body", headers)


REFUSALS = (BodyTooLarge, ValidationError, InvalidBody, SpecdecError)  # what a request is refused for before it runs


def refused(exc: Exception, headers: dict[str, str] | None = None) -> JSONResponse:
    """One of REFUSALS as its response: 413, 400 for a body that is not the model, or its SpecdecError's status."""
    if isinstance(exc, BodyTooLarge):
        return too_large(exc, headers)
    if isinstance(exc, ValidationError):
        return invalid_body(exc.errors())
    if isinstance(exc, InvalidBody):
        return invalid_body(exc.errors)
    return failed(exc, headers)


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def gone(headers: dict[str, str]) -> JSONResponse:
    """The answer to a client that left: nobody reads it. 499 is nginx's "client closed request",
    which keeps abandoned requests out of the server-error counts of whatever logs statuses."""
    return error(499, "the client closed the connection; the request was cancelled", "invalid_request_error",
                 "client_closed_request", headers=headers)


async def _disconnected(raw: Request) -> None:
    """Returns once the client has disconnected. After the body, the next ASGI message is
    http.disconnect, which the server sends when the connection closes."""
    while (await raw.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # nothing else is expected after the body; never spin on it


async def unless_gone(raw: Request, work: Awaitable[T]) -> T:
    """The result of `work`, run as a task that is cancelled if the client disconnects first (then
    ClientGone). Cancelling unwinds the generation: it leaves the admission queue, or releases its
    running slot and both services' sequences, so an abandoned request stops costing at once."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task not in done and watch.exception() is not None:  # the server cannot tell us: just wait
            await asyncio.wait((task,))
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # let it release what it holds before the handler returns
    if task.cancelled():
        raise ClientGone()
    return task.result()
