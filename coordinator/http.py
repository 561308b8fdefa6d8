"""An OpenAI-compatible HTTP API over the coordinator, plus /health, /metrics, /version and /tokenize.

Requests are pydantic models (coordinator/openai_schema.py), translated into the GenerateRequest the
gRPC API takes, so one validator (coordinator/validate.py), one speculative loop and one set of
statistics serve both; speculation statistics ride along in each response under "speculation".
Errors use OpenAI's envelope, {"error": {"message", "type", "param", "code"}}, with `param` the
request's own field name, for every status this app returns (404 and 405 included).

Bounded before any work: a body past --max-body-bytes is a 413 before it is read (or as it arrives,
when chunked), and the prompt's length is checked before it is tokenized, off the event loop
(coordinator/validate.py). A request whose client disconnects is cancelled at once, streamed or not,
queued or running, so abandoned requests hold no running slot and no sequence.

The request id is the client's `X-Request-Id` header when it sends one (else a fresh one): it is
the id in the logs, the response's `id` ("cmpl-<id>") and its `X-Request-Id` header, so one id
follows a request from the client through the coordinator to both services' logs.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

import structlog

from coordinator import bodies
from coordinator import openai_schema as schema
from coordinator.bodies import InvalidBody
from coordinator.policy.admission import client_key
from coordinator.validate import bearer, check_request_id, token_matches
from specdec.errors import InvalidArgument, Overloaded, SpecdecError, Unavailable
from specdec.serving.logs import bind_request
from specdec.spec.checks import check_token_ids
from specdec.version import package_version as version

log = structlog.get_logger(__name__)

T = TypeVar("T")

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
# status, OpenAI's error type, and the code when the error has none of its own
KINDS: dict[type, tuple[int, str, str]] = {
    InvalidArgument: (400, "invalid_request_error", "invalid_value"),
    Overloaded: (429, "rate_limit_error", "rate_limit_exceeded"),
    Unavailable: (503, "service_unavailable_error", "service_unavailable"),
}
REQUEST_ID_HEADER = "x-request-id"


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


async def _first(steps):
    return await steps.__anext__()


async def _rest(steps) -> list:
    return [chunk async for chunk in steps]


def _draining(servicer) -> bool:
    drain = getattr(servicer, "drain", None)  # the gRPC server's Drain, set by serve()
    return bool(drain is not None and drain.draining)


def speculation_json(s) -> dict:
    """The loop's Stats as JSON: what speculation did for this request."""
    return {
        "steps": s.steps, "draft_steps": s.draft_steps, "load_capped_steps": s.load_capped_steps, "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 4),
        "accepted_per_position": list(s.accepted_per_position), "draft_seconds": round(s.draft_seconds, 6),
        "verify_seconds": round(s.verify_seconds, 6), "wire_seconds": round(s.wire_seconds, 6),
        "time_to_first_token_seconds": round(s.time_to_first_token_seconds, 6), "first_step_tokens": s.first_step_tokens,
        "total_seconds": round(s.total_seconds, 6),
        "runahead_steps": s.runahead_steps, "runahead_hits": s.runahead_hits, "runahead_tokens": s.runahead_tokens,
        "runahead_used_tokens": s.runahead_used_tokens,
        "prediction_tokens": s.prediction_tokens, "accepted_prediction_tokens": s.accepted_prediction_tokens,
    }


def usage_json(stats) -> dict:
    """OpenAI's usage; with a prediction that drafted, its completion_tokens_details too: the
    prediction's tokens the target accepted, and those it drafted and rejected."""
    usage = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
             "total_tokens": stats.prompt_tokens + stats.completion_tokens}
    if stats.prediction_tokens:
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.prediction_tokens - stats.accepted_prediction_tokens}
    return usage


# JSON has no -Infinity, the log-probability of an alternative that top-k or top-p removed: it is
# written as this floor, as OpenAI's API and vLLM write it.
LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class Logprobs:
    """Turns the target's TokenLogprobs into OpenAI's two shapes (completions and chat)."""

    def __init__(self, tokenizer, chat: bool, offset: int = 0):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, offset

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def json(self, logprobs) -> dict | None:
        if self.chat:
            content = []
            for lp in logprobs:
                text = self._text(lp.token_id)
                tops = [{"token": (t := self._text(i)), "logprob": _logprob(v), "bytes": list(t.encode("utf-8"))} for i, v in lp.top]
                content.append({"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode("utf-8")),
                                "top_logprobs": tops})
            return {"content": content}
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(self._text(lp.token_id))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        tops = [{self._text(i): _logprob(v) for i, v in lp.top} for lp in logprobs]
        return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in logprobs], "top_logprobs": tops,
                "text_offset": offsets}


def _openapi(app: FastAPI) -> dict:
    """The generated document, with the request models (the routes read raw bodies, to validate
    them strictly in one place) and responses registered as components."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    ref = "#/components/schemas/{model}"
    for model in (schema.CompletionRequest, schema.ChatCompletionRequest, schema.CompletionResponse,
                  schema.ChatCompletionResponse, schema.ErrorResponse):
        body = model.model_json_schema(ref_template=ref)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    for path, request_model, response_model in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                                                ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")):
        post = doc["paths"][path]["post"]
        post["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": ref.format(model=request_model)}}}}
        post["responses"] = {
            "200": {"description": "The completion (JSON), or server-sent events of chunks ending in `data: [DONE]` with stream: true",
                    "content": {"application/json": {"schema": {"$ref": ref.format(model=response_model)}}}},
            **{str(status): {"description": text, "content": {"application/json": {"schema": {"$ref": ref.format(model="ErrorResponse")}}}}
               for status, text in ((400, "A field is invalid or unsupported (named in `param`)"), (401, "No bearer token"),
                                    (403, "Wrong bearer token"), (404, "Unknown model"), (429, "At capacity (Retry-After)"),
                                    (503, "Starting or shutting down (Retry-After)"))},
        }
    app.openapi_schema = doc
    return doc


def build_app(servicer, model_names: list[str], api_token: str = "", max_body_bytes: int = 16 * 1024 * 1024) -> FastAPI:
    """`servicer` is the CoordinatorServicer: its `_generate` runs requests, its readiness gates
    /health. `model_names`: the ids /v1/models lists and requests may name (the first is shown).
    `max_body_bytes`: the largest request body read (413 past it)."""
    app = FastAPI(title="specdec", version=version(),
                  description="OpenAI-compatible completions over speculative decoding (specdec).")
    app.openapi = lambda: _openapi(app)
    started = int(time.time())
    _error_handlers(app)
    _token_routes(app, servicer, max_body_bytes)

    app.add_middleware(Authenticate, api_token=api_token)

    @app.get("/health")
    async def health():
        """503 while loading, from SIGTERM on, and while the target cannot be reached, like gRPC
        health: a load balancer stops sending here. The draft's state is in the body only: without a
        draft the target decodes alone, slower but with the same output (coordinator/readiness.py)."""
        if _draining(servicer):
            return JSONResponse({"status": "draining"}, status_code=503)
        if servicer.loop is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        backends = getattr(servicer, "backends", None)
        if backends is None:
            return JSONResponse({"status": "ok"})
        if not backends.target_up:
            return JSONResponse({"status": "target unavailable", **backends.status()}, status_code=503)
        return JSONResponse({"status": "ok", **backends.status()})

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_route():
        return {"version": version()}

    @app.get("/v1/models")
    async def models():
        info = servicer.target_info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "specdec", "root": info.model or name,
             "parent": None, "max_model_len": info.max_context or None} for name in model_names]}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await _complete(servicer, raw, schema.CompletionRequest, model_names, max_body_bytes)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await _complete(servicer, raw, schema.ChatCompletionRequest, model_names, max_body_bytes)

    return app


class Authenticate:
    """The bearer token on the API's routes. Plain ASGI, not `@app.middleware("http")`: starlette's
    BaseHTTPMiddleware re-sends the response it wraps and ends it itself, so a stream StallingStream
    left unfinished (to have the connection dropped) went out with a clean chunked terminator."""

    def __init__(self, app, api_token: str):
        self.app, self.api_token = app, api_token

    async def __call__(self, scope, receive, send) -> None:
        if self.api_token and scope["type"] == "http" and scope["path"].startswith(("/v1/", "/tokenize", "/detokenize")):
            header = Headers(scope=scope).get("authorization", "")
            if bearer(header) is None:
                return await error(401, "missing bearer token", "authentication_error", "missing_api_key")(scope, receive, send)
            if not token_matches(header, self.api_token):
                return await error(403, "invalid bearer token", "permission_error", "invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's envelope, FastAPI's own (404, 405) and unexpected ones included."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error(exc.status_code, message, kind, code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = _location(tuple(p for p in first["loc"] if p != "body"))
        return error(400, f"{param}: {first['msg']}", "invalid_request_error", "invalid_value", param)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return gone({})

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error")


def _token_routes(app: FastAPI, servicer, max_body_bytes: int) -> None:
    """vLLM's /tokenize and /detokenize: what a prompt costs in target tokens, before sending it."""

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        """The prompt's target token ids, as /v1/completions (`prompt`) or the chat (`messages`) would send them."""
        try:
            body = await bodies.parse(TokenizeRequest, await read_body(raw, max_body_bytes), servicer.config.max_prompt_tokens)
            request = schema.to_generate_request(body.as_request(), "tokenize")
            ids = await asyncio.to_thread(servicer.prompt_ids, request)  # tokenizing is work: off the event loop
        except REFUSALS as exc:
            return refused(exc)
        return {"tokens": ids, "count": len(ids), "max_model_len": servicer.target_info.max_context or None}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        try:
            body = await bodies.parse(DetokenizeRequest, await read_body(raw, max_body_bytes), servicer.config.max_prompt_tokens)
            if servicer.tokenizer is None:
                raise Unavailable("the coordinator is still loading its tokenizer")
            if servicer.target_info.vocab_size:  # the tokenizer would drop a wrong id silently: "" for it
                check_token_ids("tokens", body.tokens, servicer.target_info.vocab_size)
        except REFUSALS as exc:
            return refused(exc)
        return {"prompt": servicer.tokenizer.decode(body.tokens)}


class TokenizeRequest(schema.Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[schema.ChatMessage] | None = None

    def as_request(self) -> schema.Sampling:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgument("prompt", "send one of prompt or messages")
        if self.messages is not None:
            return schema.ChatCompletionRequest(messages=self.messages, max_tokens=1)
        return schema.CompletionRequest(prompt=self.prompt, max_tokens=1)


class DetokenizeRequest(schema.Strict):
    model: str | None = None
    tokens: list[schema.TokenId]


async def _complete(servicer, raw: Request, model: type[BaseModel], model_names: list[str], max_body_bytes: int):
    """One completion: validated and run by the servicer's `_generate`, as a gRPC request is. Until
    its response starts, the generation runs in tasks cancelled if the client leaves (`unless_gone`);
    a streamed response is cancelled by starlette when the client leaves after that."""
    request_id = raw.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}
    if _draining(servicer):  # as the gRPC Drain interceptor refuses new calls with UNAVAILABLE
        return failed(Unavailable("the coordinator is shutting down; retry on another replica"), headers)
    chat = model is schema.ChatCompletionRequest
    try:
        check_request_id(request_id)
        bind_request(request_id)  # here, so the tasks the generation runs in all log with the id
        body = await bodies.parse(model, await read_body(raw, max_body_bytes), servicer.config.max_prompt_tokens)
        if body.model is not None and body.model not in model_names:
            return error(404, f"The model `{body.model}` does not exist (served: {', '.join(model_names)}).",
                         "invalid_request_error", "model_not_found", "model", headers)
        request = schema.to_generate_request(body, request_id)
        id_header = servicer.config.client_id_header
        client = client_key(raw.client.host if raw.client else "?", raw.headers.get(id_header, "") if id_header else "")
        steps = servicer._generate(request, client, whole=not body.stream)
        first = await unless_gone(raw, _first(steps))  # validation errors surface here, before any bytes are sent
    except REFUSALS as exc:
        return refused(exc, headers)
    except ClientGone:
        return gone(headers)
    echo = ""
    if not chat and body.echo:
        echo = request.text or servicer.tokenizer.decode(list(request.token_ids.ids))
    logprobs = Logprobs(servicer.tokenizer, chat, len(echo)) if request.HasField("logprobs") else None
    reply = Reply(f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", int(time.time()), body.model or model_names[0], chat,
                  logprobs, echo)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        stall_timeout_s = getattr(getattr(servicer, "config", None), "stream_stall_timeout_s", 0.0)  # as its gRPC streams
        return StallingStream(reply.events(first, steps, usage), stall_timeout_s, media_type="text/event-stream", headers=headers)
    try:
        rest = await unless_gone(raw, _rest(steps))
    except SpecdecError as exc:
        return failed(exc, headers)
    except ClientGone:
        return gone(headers)
    return JSONResponse(reply.whole([first, *rest]), headers=headers)


class StallingStream(StreamingResponse):
    """Server-sent events that end when the client stops reading, as --stream-stall-timeout-s ends a
    gRPC stream: a send that TCP flow control holds past `stall_timeout_s` closes the events' iterator
    (which cancels the request, freeing its running slot and both services' sequences) and leaves the
    response unfinished: uvicorn then closes the connection without the chunked body's last chunk, so
    the client sees a broken response, not a whole one (no middleware may finish it: Authenticate).
    0: wait as long as the client does."""

    def __init__(self, content, stall_timeout_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if not self.stall_timeout_s:
            return await super().__call__(scope, receive, send)
        stalled = False

        async def timed(message) -> None:
            nonlocal stalled
            if stalled:
                return  # nothing more goes to a client that stopped reading
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                stalled = True
                log.warning("ending a stream whose client stopped reading", stall_timeout_s=self.stall_timeout_s)
                await self.body_iterator.aclose()

        await super().__call__(scope, receive, timed)


class Reply:
    """One response's ids and shapes: a whole completion, or its chunks as server-sent events."""

    def __init__(self, ident: str, created: int, model: str, chat: bool, logprobs: Logprobs | None, echo: str):
        self.ident, self.created, self.model, self.chat, self.logprobs, self.echo = ident, created, model, chat, logprobs, echo

    def _envelope(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    def whole(self, chunks) -> dict:
        last = chunks[-1]
        text = self.echo + "".join(c.text for c in chunks)
        lps = self.logprobs.json([lp for c in chunks for lp in c.logprobs]) if self.logprobs else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH[last.finish], "logprobs": lps}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice],
                              usage=usage_json(last.stats), speculation=speculation_json(last.stats))

    def _chunk(self, text: str | None, finish: str | None, logprobs=(), role: bool = False, **extra) -> str:
        lps = self.logprobs.json(logprobs) if self.logprobs and logprobs else None
        reason = FINISH.get(finish) if finish else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": reason}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {json.dumps(self._envelope(kind, [choice], **extra))}\n\n"

    async def events(self, first, steps, include_usage: bool):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. With
        stream_options.include_usage, a last chunk with empty `choices` carries the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            yield self._chunk(None, None, role=True)
        elif self.echo:
            yield self._chunk(self.echo, None)
        chunk = first
        try:
            while chunk is not None:
                if chunk.text or chunk.logprobs:
                    yield self._chunk(chunk.text, None, chunk.logprobs)
                if chunk.finish:
                    yield self._chunk(None, chunk.finish, speculation=speculation_json(chunk.stats))
                    if include_usage:
                        yield f"data: {json.dumps(self._envelope(kind, [], usage=usage_json(chunk.stats)))}\n\n"
                    break
                try:
                    chunk = await steps.__anext__()
                except StopAsyncIteration:
                    chunk = None
                except SpecdecError as exc:
                    body = json.loads(failed(exc).body)
                    yield f"data: {json.dumps(body)}\n\n"
                    break
        finally:
            await steps.aclose()
        yield "data: [DONE]\n\n"
