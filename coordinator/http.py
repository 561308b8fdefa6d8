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

The routes are here; the refusals in OpenAI's envelope are http_errors.py, the replies' shapes
http_replies.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

import structlog

from coordinator import bodies
from coordinator import openai_schema as schema
from coordinator.http_errors import REFUSALS, ClientGone, _location, error, failed, gone, read_body, refused, unless_gone
from coordinator.http_replies import Logprobs, Reply, StallingStream
from coordinator.policy.admission import client_key
from coordinator.validate import bearer, check_request_id, token_matches
from specdec.errors import InvalidArgument, SpecdecError, Unavailable
from specdec.serving.logs import bind_request
from specdec.calls.checks import check_token_ids
from specdec.version import package_version as version

log = structlog.get_logger(__name__)

REQUEST_ID_HEADER = "x-request-id"


async def _first(steps):
    return await steps.__anext__()


async def _rest(steps) -> list:
    return [chunk async for chunk in steps]


def _draining(servicer) -> bool:
    drain = getattr(servicer, "drain", None)  # the gRPC server's Drain, set by serve()
    return bool(drain is not None and drain.draining)




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
             "parent": None, "max_model_len": info.max_context or None, "numerics": info.numerics or None}
            for name in model_names]}

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
