"""An OpenAI-compatible HTTP API over the coordinator, plus /health and Prometheus /metrics.

Requests are translated into the same GenerateRequest the gRPC API takes, so validation, the
speculative loop and the statistics are shared; speculation statistics ride along in each response
under "speculation". Extensions to OpenAI's request: `top_k`, `draft_length`, `adaptive`.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from protos import specdec_pb2 as pb
from specdec.errors import InvalidArgument, Overloaded, SpecdecError, Unavailable

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
STATUS = {InvalidArgument: 400, Overloaded: 429, Unavailable: 503}


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise InvalidArgument(name, f"must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def to_request(body: dict, chat: bool) -> tuple[pb.GenerateRequest, bool]:  # noqa: C901 - see CoordinatorServicer._spec
    """OpenAI JSON -> GenerateRequest (and whether to stream). Type errors name the JSON field."""
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    request = pb.GenerateRequest()
    if chat:
        messages = _field(body, "messages", (list,))
        if not messages:
            raise InvalidArgument("messages", "must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise InvalidArgument(f"messages[{i}]", "must be an object with a string content")
            request.chat.messages.add(role=str(message.get("role", "")), content=message["content"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.text = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            request.token_ids.ids.extend(prompt)
        else:
            raise InvalidArgument("prompt", "must be a string or a list of token ids (one prompt per request)")
    if _field(body, "n", (int,), 1) != 1:
        raise InvalidArgument("n", "only n = 1 is supported")
    max_tokens = _field(body, "max_completion_tokens", (int,)) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _field(body, "max_tokens", (int,), 16 if not chat else None)
    if max_tokens is not None:
        request.max_new_tokens = max_tokens
    request.sampling.temperature = float(_field(body, "temperature", (int, float), 1.0))  # OpenAI's default
    for name in ("top_p",):
        if (value := _field(body, name, (int, float))) is not None:
            request.sampling.top_p = float(value)
    if (top_k := _field(body, "top_k", (int,))) is not None and top_k >= 0:
        request.sampling.top_k = top_k
    if (seed := _field(body, "seed", (int,))) is not None:
        if seed < 0:
            raise InvalidArgument("seed", "must be >= 0")
        request.sampling.seed = seed
    stop = body.get("stop")
    request.stop.extend([stop] if isinstance(stop, str) else (stop or []))
    if (length := _field(body, "draft_length", (int,))) is not None:
        request.speculation.draft_length = length
    if (adaptive := _field(body, "adaptive", (bool,))) is not None:
        request.speculation.adaptive = adaptive
    return request, bool(_field(body, "stream", (bool,), False))


def speculation_json(s) -> dict:
    """The loop's Stats as JSON: what speculation did for this request."""
    return {
        "steps": s.steps, "draft_steps": s.draft_steps, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 4),
        "accepted_per_position": list(s.accepted_per_position), "draft_seconds": round(s.draft_seconds, 6),
        "verify_seconds": round(s.verify_seconds, 6), "wire_seconds": round(s.wire_seconds, 6),
        "time_to_first_token_seconds": round(s.time_to_first_token_seconds, 6), "first_step_tokens": s.first_step_tokens,
        "total_seconds": round(s.total_seconds, 6),
        "runahead_steps": s.runahead_steps, "runahead_hits": s.runahead_hits, "runahead_tokens": s.runahead_tokens,
        "runahead_used_tokens": s.runahead_used_tokens,
    }


def usage_json(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def build_app(servicer, model_name: str, api_token: str = "") -> FastAPI:  # noqa: C901 - see CoordinatorServicer._spec
    """`servicer` is the CoordinatorServicer: its `_generate` runs requests, its readiness gates /health."""
    app = FastAPI(title="specdec", version="0.1.0")

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_token and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if not header.startswith("Bearer "):
                return _error(401, "missing bearer token", kind="authentication_error")
            if not hmac.compare_digest(header.removeprefix("Bearer ").strip(), api_token):
                return _error(403, "invalid bearer token", kind="permission_error")
        return await call_next(request)

    def draining() -> bool:
        drain = getattr(servicer, "drain", None)  # the gRPC server's Drain, set by serve()
        return bool(drain is not None and drain.draining)

    @app.get("/health")
    async def health():
        """503 while loading and from SIGTERM on, like gRPC health: a load balancer stops sending here."""
        if draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        ready = servicer.loop is not None
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}

    async def run(raw: Request, chat: bool):
        if draining():  # as the gRPC Drain interceptor refuses new calls with UNAVAILABLE
            return _error(503, "the coordinator is shutting down; retry on another replica", kind="service_unavailable")
        try:
            body = json.loads(await raw.body() or b"null")
        except json.JSONDecodeError as exc:
            return _error(400, f"body is not valid JSON: {exc}", "body")
        try:
            request, stream = to_request(body, chat)
            token = raw.headers.get("authorization", "")
            client = f"token:{hash(token)}" if token else f"peer:{raw.client.host if raw.client else '?'}"
            steps = servicer._generate(request, client)
            first = await steps.__anext__()  # validation errors surface here, before any bytes are sent
        except SpecdecError as exc:
            return _error(STATUS.get(type(exc), 500), str(exc), getattr(exc, "field", None))
        created, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if stream:
            return StreamingResponse(_sse(first, steps, chat, ident, created, model_name), media_type="text/event-stream")
        pieces, finish, stats = [first[2]], first[3], first[4]
        try:
            async for _spec, _tokens, piece, finish, stats in steps:  # noqa: B007 - the last values are used below
                pieces.append(piece)
        except SpecdecError as exc:
            return _error(STATUS.get(type(exc), 500), str(exc), getattr(exc, "field", None))
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": FINISH[finish], "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model_name,
                "choices": [choice], "usage": usage_json(stats), "speculation": speculation_json(stats)}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await run(raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await run(raw, chat=True)

    return app


async def _sse(first, steps, chat: bool, ident: str, created: int, model: str):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None, role: bool = False, extra: dict | None = None) -> str:
        if chat:
            delta = {"role": "assistant"} if role else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": FINISH.get(finish) if finish else None, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": FINISH.get(finish) if finish else None, "logprobs": None}
        payload = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice], **(extra or {})}
        return f"data: {json.dumps(payload)}\n\n"

    if chat:
        yield chunk(None, None, role=True)
    item = first
    while item is not None:
        _spec, _tokens, piece, finish, stats = item
        if piece:
            yield chunk(piece, None)
        if finish:
            yield chunk(None, finish, extra={"usage": usage_json(stats), "speculation": speculation_json(stats)})
            break
        try:
            item = await steps.__anext__()
        except StopAsyncIteration:
            item = None
        except SpecdecError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': type(exc).__name__}})}\n\n"
            break
    await steps.aclose()
    yield "data: [DONE]\n\n"
