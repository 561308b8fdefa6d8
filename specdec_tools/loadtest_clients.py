"""`specdec loadtest`'s clients: one request sent and timed (TTFT, ITL, E2EL as vLLM's
benchmark_serving defines them) over the coordinator's gRPC stream (GrpcClient) or its
OpenAI-compatible server-sent events (HttpClient), each into a RequestResult.

Apart from loadtest.py (the run: stacks, levels, checks) because how one request is timed is the
measurement itself, and reads best on its own.
"""

from __future__ import annotations

import dataclasses
import json
import time

from specdec_tools import connect


@dataclasses.dataclass
class RequestResult:
    prompt_index: int
    ok: bool
    code: str = "OK"
    details: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)  # gRPC: the token ids; HTTP: none (text only)
    text: str = ""  # HTTP: the completion's text
    output_tokens: int = 0  # gRPC: len(tokens); HTTP: the server's usage.completion_tokens, else content chunks
    exact_count: bool = False  # output_tokens counted exactly (token ids, or the server's usage), not as content chunks
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    retry_after_ms: int | None = None
    request_index: int = 0
    sent: float = 0.0  # seconds from the level's start to this request's send
    prompt_tokens: int = 0


# --- the clients ----------------------------------------------------------------------------------

class GrpcClient:
    """CoordinatorService.GenerateStream over one channel (its token and TLS from connect.Connection)."""

    def __init__(self, conn: connect.Connection, timeout: float, ignore_eos: bool = False):
        self.conn, self.timeout, self.ignore_eos = conn, timeout, ignore_eos

    async def __aenter__(self) -> GrpcClient:
        from protos import specdec_pb2_grpc as pb_grpc
        from specdec.serving.rpc import CHANNEL_OPTIONS

        self.channel = self.conn.aio_channel(options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def request(self, index: int, prompt: list[int], max_new: int, speculation: bool) -> RequestResult:
        import grpc

        from protos import specdec_pb2 as pb

        spec = pb.SpeculationParams() if speculation else pb.SpeculationParams(draft_length=0)
        request = pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new, speculation=spec,
                                           ignore_eos=self.ignore_eos)
        result = RequestResult(index, ok=False, exact_count=True)
        start = last = time.perf_counter()
        call = self.stub.GenerateStream(request, timeout=self.timeout, metadata=self.conn.metadata)
        try:
            async for message in call:
                now = time.perf_counter()
                if message.token_ids:
                    if not result.tokens:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.tokens.extend(message.token_ids)
                if message.HasField("stats"):
                    s = message.stats
                    result.draft_tokens, result.accepted_tokens, result.steps = s.draft_tokens, s.accepted_tokens, s.steps
            result.ok = True
        except grpc.aio.AioRpcError as exc:
            result.code, result.details = exc.code().name, exc.details() or ""
            for key, value in exc.trailing_metadata() or ():
                if key == "retry-after-ms":
                    result.retry_after_ms = int(value)
        result.e2el = time.perf_counter() - start
        result.output_tokens = len(result.tokens)
        return result


# HTTP statuses under the gRPC code names the report and refused_access use for the same refusals.
HTTP_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
              503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def _http_error(status: int, body: bytes) -> tuple[str, str]:
    """(code, message) of a refused request: OpenAI's {"error": {"message": ...}} when the body has it."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return HTTP_CODES.get(status, f"HTTP_{status}"), f"HTTP {status}: {message}"


class HttpClient:
    """POST /v1/completions with `stream: true` on the coordinator's OpenAI-compatible API, read as
    server-sent events. The prompt goes as token ids, so both APIs get the same tokens; the token
    goes as `Authorization: Bearer`. Usage is asked for (`stream_options.include_usage`): OpenAI
    sends it in a last chunk of its own (empty `choices`); a server that sends none leaves the count
    of content chunks, a lower bound when a chunk carries several tokens."""

    def __init__(self, base_url: str, token: str, timeout: float, ignore_eos: bool, verify: object = True):
        self.base_url, self.timeout, self.ignore_eos, self.verify = base_url.rstrip("/"), timeout, ignore_eos, verify
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.model = ""

    async def __aenter__(self) -> HttpClient:
        import httpx2

        # No cap on connections: the load test's own concurrency is the only limit.
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx2.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout, limits=limits,
                                         verify=self.verify)
        try:
            self.model = await self.served_model()
        except BaseException:
            await self.client.aclose()  # __aexit__ does not run when __aenter__ fails
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    async def served_model(self) -> str:
        """The model the server names in GET /v1/models (it checks the token as completions do):
        ConnectError, in one line, when nothing answers there or the token is refused."""
        import httpx2

        try:
            response = await self.client.get("/v1/models")
        except httpx2.HTTPError as exc:
            raise connect.ConnectError(f"cannot reach the HTTP API at {self.base_url}: {exc or type(exc).__name__}") from None
        if response.status_code != 200:
            code, message = _http_error(response.status_code, response.content)
            advice = connect.hint(code, message, connect.Connection(self.base_url))
            raise connect.ConnectError(f"{self.base_url}/v1/models: {message}" + (f" ({advice})" if advice else ""))
        models = response.json().get("data") or [{}]
        return models[0].get("id", "")

    def body(self, prompt: list[int], max_new: int, speculation: bool) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if not speculation:
            body["draft_length"] = 0  # specdec's extension: speculation off for this request
        return body

    async def request(self, index: int, prompt: list[int], max_new: int, speculation: bool) -> RequestResult:
        import httpx2

        result = RequestResult(index, ok=False)
        chunks, done = 0, False
        start = last = time.perf_counter()
        try:
            async with self.client.stream("POST", "/v1/completions", json=self.body(prompt, max_new, speculation)) as response:
                if response.status_code != 200:
                    result.code, result.details = _http_error(response.status_code, await response.aread())
                    if "retry-after-ms" in response.headers:
                        result.retry_after_ms = int(response.headers["retry-after-ms"])
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # blank separators, comments, other SSE fields
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            result.code, result.details = "STREAM_ERROR", str(chunk["error"].get("message", chunk["error"]))
                            break
                        now = time.perf_counter()
                        piece = "".join(choice.get("text") or "" for choice in chunk.get("choices") or ())
                        if piece:
                            if not chunks:
                                result.ttft = now - start
                            else:
                                result.itl.append(now - last)
                            last, chunks = now, chunks + 1
                            result.text += piece
                        if chunk.get("usage"):
                            result.output_tokens, result.exact_count = chunk["usage"]["completion_tokens"], True
                        if chunk.get("speculation"):
                            s = chunk["speculation"]
                            result.draft_tokens, result.accepted_tokens, result.steps = s["draft_tokens"], s["accepted_tokens"], s["steps"]
        except httpx2.HTTPError as exc:
            result.code, result.details = "CONNECTION_ERROR", f"{type(exc).__name__}: {exc}"
        else:
            if response.status_code == 200 and not done and result.code == "OK":
                result.code, result.details = "STREAM_ERROR", "the event stream ended without data: [DONE]"
            result.ok = done
        if not result.exact_count:
            result.output_tokens = chunks
        result.e2el = time.perf_counter() - start
        return result
