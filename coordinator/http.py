"""An OpenAI-compatible HTTP API over the coordinator, plus /health and Prometheus /metrics.

Requests are translated into the same GenerateRequest the gRPC API takes, so validation (one
validator, coordinator/validate.py: its errors name the GenerateRequest field), the speculative loop
and the statistics are shared; speculation statistics ride along in each response under
"speculation". This module checks only what the translation needs: JSON types (named by their JSON
field) and what a GenerateRequest cannot express (n > 1, a negative seed).
Extensions to OpenAI's request: `top_k`, `draft_length`, `adaptive`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.validate import token_matches
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


def _prompt(body: dict, request: pb.GenerateRequest) -> None:
    """/v1/completions: one prompt, as a string or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.token_ids.ids.extend(prompt)
    else:
        raise InvalidArgument("prompt", "must be a string or a list of token ids (one prompt per request)")


def _messages(body: dict, request: pb.GenerateRequest) -> None:
    """/v1/chat/completions: the conversation (its roles are checked with the gRPC API's chat)."""
    messages = _field(body, "messages", (list,))
    if not messages:
        raise InvalidArgument("messages", "must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise InvalidArgument(f"messages[{i}]", "must be an object with a string content")
        request.chat.messages.add(role=str(message.get("role", "")), content=message["content"])


def _max_tokens(body: dict, chat: bool) -> int | None:
    """max_completion_tokens (chat) or max_tokens; completions default to OpenAI's 16, chat to the coordinator's."""
    max_tokens = _field(body, "max_completion_tokens", (int,)) if chat else None
    return max_tokens if max_tokens is not None else _field(body, "max_tokens", (int,), 16 if not chat else None)


def _sampling(body: dict, sampling: pb.SamplingParams) -> None:
    sampling.temperature = float(_field(body, "temperature", (int, float), 1.0))  # OpenAI's default
    if (top_p := _field(body, "top_p", (int, float))) is not None:
        sampling.top_p = float(top_p)
    if (top_k := _field(body, "top_k", (int,))) is not None and top_k >= 0:  # a negative top_k (vLLM's -1) means off
        sampling.top_k = top_k
    if (seed := _field(body, "seed", (int,))) is not None:
        if seed < 0:
            raise InvalidArgument("seed", "must be >= 0")
        sampling.seed = seed


def _speculation(body: dict, speculation: pb.SpeculationParams) -> None:
    if (length := _field(body, "draft_length", (int,))) is not None:
        speculation.draft_length = length
    if (adaptive := _field(body, "adaptive", (bool,))) is not None:
        speculation.adaptive = adaptive


def to_request(body: dict, chat: bool) -> tuple[pb.GenerateRequest, bool]:
    """OpenAI JSON -> GenerateRequest (and whether to stream). Type errors name the JSON field; the
    values are checked with the gRPC API's, by coordinator/validate.py."""
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    request = pb.GenerateRequest()
    (_messages if chat else _prompt)(body, request)
    if _field(body, "n", (int,), 1) != 1:
        raise InvalidArgument("n", "only n = 1 is supported")
    if (max_tokens := _max_tokens(body, chat)) is not None:
        request.max_new_tokens = max_tokens
    _sampling(body, request.sampling)
    stop = body.get("stop")
    request.stop.extend([stop] if isinstance(stop, str) else (stop or []))
    _speculation(body, request.speculation)
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


def _draining(servicer) -> bool:
    drain = getattr(servicer, "drain", None)  # the gRPC server's Drain, set by serve()
    return bool(drain is not None and drain.draining)


def _failed(exc: SpecdecError) -> JSONResponse:
    return _error(STATUS.get(type(exc), 500), str(exc), getattr(exc, "field", None))


def build_app(servicer, model_name: str, api_token: str = "") -> FastAPI:
    """`servicer` is the CoordinatorServicer: its `_generate` runs requests, its readiness gates /health."""
    app = FastAPI(title="specdec", version="0.1.0")

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_token and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if not header.startswith("Bearer "):
                return _error(401, "missing bearer token", kind="authentication_error")
            if not token_matches(header, api_token):
                return _error(403, "invalid bearer token", kind="permission_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        """503 while loading and from SIGTERM on, like gRPC health: a load balancer stops sending here."""
        if _draining(servicer):
            return JSONResponse({"status": "draining"}, status_code=503)
        ready = servicer.loop is not None
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await _complete(servicer, raw, False, model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await _complete(servicer, raw, True, model_name)

    return app


async def _complete(servicer, raw: Request, chat: bool, model_name: str):
    """One completion: validated and run by the servicer's `_generate`, as a gRPC request is."""
    if _draining(servicer):  # as the gRPC Drain interceptor refuses new calls with UNAVAILABLE
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
        return _failed(exc)
    created, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if stream:
        return StreamingResponse(_sse(first, steps, chat, ident, created, model_name), media_type="text/event-stream")
    pieces, finish, stats = [first[2]], first[3], first[4]
    try:
        async for _spec, _tokens, piece, finish, stats in steps:  # noqa: B007 - the last values are used below
            pieces.append(piece)
    except SpecdecError as exc:
        return _failed(exc)
    text = "".join(pieces)
    choice = {"index": 0, "finish_reason": FINISH[finish], "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model_name,
            "choices": [choice], "usage": usage_json(stats), "speculation": speculation_json(stats)}


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
