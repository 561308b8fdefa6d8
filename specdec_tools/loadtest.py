"""`specdec loadtest`: many concurrent requests through the coordinator's own gRPC API.

Why a load tester of our own: speculation that only pays for one stream is a demo; what matters
for a server is aggregate output tokens/s and latency percentiles as concurrent streams grow, with
every response still exactly the target's (greedy) and overload answered with RESOURCE_EXHAUSTED
rather than a crash or unbounded queues. Metrics follow vLLM's benchmark_serving names and
definitions, so numbers compare directly:
  TTFT  first streamed token - request sent            E2EL  last token - request sent
  TPOT  (E2EL - TTFT) / (output tokens - 1)            ITL   gaps between streamed chunks
(a chunk is one target pass: with speculation it carries several tokens, as in vLLM).

It starts its own local stack (target, draft, coordinator as `specdec serve` child processes), or
drives `--address` (with --api-token and the --tls-* flags of specdec_tools/connect.py, as
`specdec generate`), or with `--http URL` a coordinator's OpenAI-compatible API: the same prompts
(token ids) to POST /v1/completions with `stream: true`, read as server-sent events up to
`data: [DONE]`, as vLLM's benchmark_serving drives an OpenAI server. `--ignore-eos` asks for exactly
--max-new-tokens tokens per request (vLLM's `ignore_eos`, either API) and the report shows the lengths
received, over HTTP counted from the `usage` the server sends last when asked with
`stream_options.include_usage`.
`--quick` runs tiny random models in well under a minute (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

from specdec_tools import connect, flags
from specdec_tools.stacks import Stack
from specdec.model.formats import FORMATS
from specdec_tools.workload import load_prompt_ids, reference_outputs

PARTIAL = "loadtest.partial.json"  # in --out while a run goes on; removed once loadtest.json is written


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


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarise(results: list[RequestResult], duration: float) -> dict:
    """vLLM's key names; latencies in milliseconds."""
    done = [r for r in results if r.ok]
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            failures[r.code] = failures.get(r.code, 0) + 1
    out_tokens = sum(r.output_tokens for r in done)
    series = {
        "ttft": [r.ttft * 1e3 for r in done],
        "tpot": [(r.e2el - r.ttft) * 1e3 / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap * 1e3 for r in done for gap in r.itl],
        "e2el": [r.e2el * 1e3 for r in done],
    }
    in_order = sorted(done, key=lambda r: r.request_index)  # sending order
    drafted = sum(r.draft_tokens for r in done)
    refused = [r for r in results if r.code == "RESOURCE_EXHAUSTED"]
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "failures": failures,
        "duration": duration,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "acceptance_rate": sum(r.accepted_tokens for r in done) / drafted if drafted else 0.0,
        "mean_tokens_per_step": out_tokens / max(1, sum(r.steps for r in done)),
        "max_refusal_latency_ms": max((r.e2el * 1e3 for r in refused), default=0.0),
        "retry_after_ms": sorted({r.retry_after_ms for r in refused if r.retry_after_ms is not None}),
        "output_lengths": [r.output_tokens for r in in_order],
        "exact_lengths": sum(r.exact_count for r in done),  # the rest: content chunks counted (no usage came)
        # Each finished request, in sending order: percentiles hide which requests waited (the prompt
        # a request sent is prompts[index % len(prompts)]).
        "requests": [{"index": r.request_index, "ttft_ms": r.ttft * 1e3, "e2el_ms": r.e2el * 1e3, "output_tokens": r.output_tokens,
                      "steps": r.steps, "draft_tokens": r.draft_tokens, "accepted_tokens": r.accepted_tokens}
                     for r in in_order],
    }
    for name, values in series.items():
        summary[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        summary[f"median_{name}_ms"] = percentile(values, 50)
        summary[f"p90_{name}_ms"] = percentile(values, 90)
        summary[f"p99_{name}_ms"] = percentile(values, 99)
    return summary


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


async def run_level(client: GrpcClient | HttpClient, prompts: list[list[int]], num_requests: int, max_new: int, speculation: bool,
                    concurrency: int | None, rate: float | None, seed: int, progress=None) -> tuple[list[RequestResult], float]:
    """`num_requests` requests, prompts cycled; at most `concurrency` in flight, or Poisson arrivals at `rate`/s."""
    async with client:
        results: list[RequestResult] = []
        task_id = progress.add_task(f"{'spec' if speculation else 'no-spec'} " + (f"c={concurrency}" if rate is None else f"rate={rate}/s"), total=num_requests) if progress else None

        async def fire(i: int) -> None:
            sent = time.perf_counter() - start
            result = await client.request(i % len(prompts), prompts[i % len(prompts)], max_new, speculation)
            result.request_index, result.sent, result.prompt_tokens = i, sent, len(prompts[i % len(prompts)])
            results.append(result)
            if progress:
                progress.advance(task_id)

        start = time.perf_counter()
        if rate is None:
            queue = iter(range(num_requests))

            async def worker():
                for i in queue:
                    await fire(i)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed)
            tasks = []
            for i in range(num_requests):
                tasks.append(asyncio.ensure_future(fire(i)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# --- the local stack ------------------------------------------------------------------------------

class LocalStack(Stack):
    """target + draft + coordinator as `specdec serve` child processes on loopback (like `specdec up`).
    `api_token`: the token its coordinator requires (empty: none, whatever this environment says)."""

    def __init__(self, target: str, drafter: str, logs: pathlib.Path, coordinator_flags: list[str], target_flags: list[str],
                 api_token: str = "", device: str = "cpu"):
        super().__init__(target, logs, device, log_level="warning")
        draft = self.start_draft(drafter)
        self.start_target(*target_flags, *self.drafts_for_target(drafter, draft))
        with _environment(SPECDEC_COORDINATOR_API_TOKEN=api_token):  # in its environment, not on a command line `ps` shows
            self.address = self.start_coordinator(draft, *coordinator_flags)


@contextlib.contextmanager
def _environment(**values: str):
    """os.environ with `values` set, for the children started inside; restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def refused_access(results: list[RequestResult], conn: connect.Connection) -> str:
    """One line when every request was turned away for its API token (no point in measuring on); '' otherwise."""
    if not results or not all(r.code in ("UNAUTHENTICATED", "PERMISSION_DENIED") for r in results):
        return ""
    first = results[0]
    return f"every request was refused: {first.code}: {' '.join(first.details.split())} ({connect.hint(first.code, first.details, conn)})"


def prompt_ids(tokenizer, prompts: str, limit: int) -> list[list[int]]:
    """--prompts: a prompt set name (specdec_tools/prompts/NAME.jsonl) or a .jsonl path, through the chat template."""
    try:
        return load_prompt_ids(tokenizer, prompts, limit)
    except FileNotFoundError as exc:
        raise ValueError(f"--prompts: {exc}") from exc


# --- the run --------------------------------------------------------------------------------------

def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specdec loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="", help="A running coordinator's gRPC address; empty: start a local stack.")
    parser.add_argument("--http", default="", metavar="URL",
                        help="Drive a running coordinator's OpenAI-compatible API instead, e.g. http://127.0.0.1:8000 "
                             "(streamed /v1/completions; --target-model names its tokenizer, for the prompts and --check).")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                        help="Ask for exactly --max-new-tokens tokens per request (vLLM's ignore_eos), for lengths that do not "
                             "depend on where the model stops; --check then compares the output up to the target's end.")
    parser.add_argument("--target-model", default="", help="Target (and tokenizer) of the local stack / reference (default: SmolLM2-135M-Instruct).")
    parser.add_argument("--drafter", default="ngram", help="ngram, or a draft model for the local stack.")
    parser.add_argument("--concurrency", default="1,2,4,8", help="Comma-separated concurrency levels, one run each.")
    parser.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second instead of fixed concurrency (0: off).")
    parser.add_argument("--num-requests", type=int, default=0, help="Requests per level (default: 2 x concurrency, at least 8).")
    parser.add_argument("--prompts", default="grounded", help="Prompt set (specdec_tools/prompts/NAME.jsonl) or a .jsonl path.")
    parser.add_argument("--max-prompts", type=int, default=16, help="Distinct prompts used (cycled).")
    parser.add_argument("--long-prompt-tokens", type=int, default=0,
                        help="Make every --long-every-th prompt this many tokens long (its ids repeated): a mix of long "
                             "and short prompts, reported apart (chunked prefill: --target-flags '--max-prefill-tokens-per-pass 0' "
                             "turns it off for the comparison).")
    parser.add_argument("--long-every", type=int, default=8, help="With --long-prompt-tokens: which prompts are long (1 in N).")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="Requests sent before measuring, per speculation mode.")
    parser.add_argument("--speculation", choices=("on", "off", "both"), default="both", help="Runs with speculation, without (draft_length 0), or both.")
    parser.add_argument("--repeats", type=int, default=1,
                        help="Runs of every level and mode, alternating which mode goes first; with both modes the summary "
                             "gives speculation's throughput over speculation off's per level: the median of the pairs, "
                             "and the lowest and highest pair.")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="Compare every response with the target decoding alone (greedy generate in this process).")
    parser.add_argument("--overload", action=argparse.BooleanOptionalAction, default=False,
                        help="Finally offer 4x (max-concurrent-requests + max-queue) concurrent requests: expect prompt RESOURCE_EXHAUSTED.")
    parser.add_argument("--max-concurrent-requests", type=int, default=32, help="Local coordinator's cap (see `specdec serve coordinator`).")
    parser.add_argument("--max-queue", type=int, default=64, help="Local coordinator's queue bound.")
    parser.add_argument("--device", default="cpu", help="Where the local stack's services compute: cpu, cuda or cuda:N "
                        "(the reference outputs too).")
    parser.add_argument("--coordinator-flags", default="",
                        help="Extra flags for the local coordinator, e.g. '--max-long-partial-prefills 0'.")
    parser.add_argument("--target-flags", default="", help="Extra flags for the local target, e.g. '--max-batch-size 1'.")
    parser.add_argument("--weights", default="fp32",
                        help=f"What the local target reads its weights as ({', '.join(FORMATS)}); several, comma-separated: one "
                             "stack after the other, each checked against the target alone in its own format, and the "
                             "summary sets each format's throughput against the first's. With --address/--http: the one "
                             "format the server runs (for --check's reference).")
    parser.add_argument("--out", default=None,
                        help=f"Folder for loadtest.json and the PNG plots ({PARTIAL} while it runs); default: a new "
                             f"{flags.RESULTS_ROOT}/loadtest-TIMESTAMP/ (the committed runs are under benchmarks/results/).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="Tiny random models, short runs, overload included: CI, < 60 s.")
    connect.add_arguments(parser)  # --api-token also makes the local stack's coordinator require it
    flags.finish(parser)
    args = parser.parse_args(argv)
    args.out = args.out or flags.fresh_out("loadtest")
    try:
        connect.Connection.from_args(args)  # the flags' combinations and files, before any stack starts
    except ValueError as exc:
        parser.error(str(exc))
    if args.address and args.http:
        parser.error("--address (gRPC) and --http (the OpenAI-compatible API) are two ways to one coordinator: give one")
    if args.http and not args.http.startswith(("http://", "https://")):
        parser.error(f"--http: a URL such as http://127.0.0.1:8000, got {args.http!r}")
    if args.http.startswith("http://") and (args.tls or args.tls_ca or args.tls_cert):
        parser.error("--tls and the --tls-* flags need an https:// URL with --http")
    if args.http and args.tls_server_name:
        parser.error("--tls-server-name is for gRPC (--address); with --http the URL's host is the name checked")
    if not (args.address or args.http) and (args.tls or args.tls_ca or args.tls_cert or args.tls_server_name):
        parser.error("--tls and the --tls-* flags need --address or --http: the local stack serves plaintext")
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency: a comma-separated list of integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        parser.error(f"--concurrency: levels must be >= 1, got {args.concurrency!r}")
    for flag in ("num_requests", "max_new_tokens", "warmup", "max_prompts", "max_concurrent_requests", "max_queue", "repeats"):
        if getattr(args, flag) < 0 or (flag in ("max_new_tokens", "repeats") and getattr(args, flag) < 1):
            parser.error(f"--{flag.replace('_', '-')}: out of range: {getattr(args, flag)}")
    if args.request_rate < 0:
        parser.error(f"--request-rate: must be >= 0, got {args.request_rate}")
    args.weights_list = list(dict.fromkeys(w.strip() for w in args.weights.split(",") if w.strip()))
    if not args.weights_list or any(w not in FORMATS for w in args.weights_list):
        parser.error(f"--weights: comma-separated formats from {', '.join(FORMATS)}, got {args.weights!r}")
    if len(args.weights_list) > 1 and (args.address or args.http):
        parser.error("--weights: several formats need the local stack (a server runs one)")
    if args.long_prompt_tokens < 0 or args.long_every < 1:
        parser.error("--long-prompt-tokens must be >= 0 and --long-every >= 1")
    if args.overload and (args.address or args.http):
        parser.error("--overload needs the local stack (its caps are known); drop --address / --http")
    return args


def run(args: argparse.Namespace) -> dict:
    from specdec.model.loading import DEFAULT_TARGET, load_tokenizer

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="specdec-loadtest-"))
    if args.quick:
        from specdec_tools.bench_runners import quick_models

        # A random model's logits are nearly flat, so the usual 8% noise flips most argmaxes and
        # n-gram drafting over 16 random tokens rarely matches: with either, the speculative runs
        # accepted nothing on some machines. The tiny target plus 2% noise agrees with it on ~70%
        # of drafted tokens, so the quick runs really exercise speculation.
        target, drafter = quick_models(workdir / "models", noise=0.02)
        args.target_model, args.drafter = target, drafter
        args.prompts, args.max_new_tokens, args.max_prompts, args.warmup = "chat", 16, 6, 1
        args.levels = [1, 4] if args.concurrency == "1,2,4,8" else args.levels
        args.num_requests = args.num_requests or 6
        args.max_concurrent_requests, args.max_queue, args.overload = 2, 2, not (args.address or args.http)
    target = args.target_model or DEFAULT_TARGET
    tokenizer = load_tokenizer(target)
    prompts = prompt_ids(tokenizer, args.prompts, args.max_prompts)
    if args.long_prompt_tokens:
        prompts = [lengthen(p, args.long_prompt_tokens) if i % args.long_every == 0 else p for i, p in enumerate(prompts)]
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.speculation]
    secret = {"api_token", "levels"}  # the token stays out of the report
    report: dict = {"config": {k: v for k, v in vars(args).items() if k not in secret} | {"levels": args.levels, "target": target,
                                                                                      "num_prompts": len(prompts),
                                                                                      "api": "http" if args.http else "grpc"}, "runs": []}
    for i, weights in enumerate(args.weights_list):
        run_format(args, weights, target, tokenizer, prompts, modes, workdir, report, overload=args.overload and i == 0)
    for entry in [*report["runs"], *([report["overload"]] if "overload" in report else [])]:
        entry.pop("_results")
    report["summary"] = headline(report["runs"])
    return report


def run_format(args: argparse.Namespace, weights: str, target: str, tokenizer, prompts: list[list[int]], modes: list[bool],
               workdir: pathlib.Path, report: dict, overload: bool) -> None:
    """Every level of one weight format: its own local stack (a target serving `weights`), its runs
    appended to report["runs"], each checked against the target alone in that format."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    stack = None
    if not (args.address or args.http):
        # The load generator is one client that stands for many: it may fill the running slots and the queue.
        caps = ["--max-concurrent-requests", str(args.max_concurrent_requests), "--max-queue", str(args.max_queue),
                "--max-streams-per-client", str(args.max_concurrent_requests + args.max_queue)]
        stack = LocalStack(target, args.drafter, workdir / f"logs-{weights}", [*caps, *args.coordinator_flags.split()], ["--weights", weights, *args.target_flags.split()],
                           api_token=args.api_token.strip(), device=args.device)
    try:
        if stack:
            stack.wait()
        conn = connect.Connection.from_args(args, address=args.address or (stack.address if stack else args.http))
        if args.address:
            connect.wait_healthy(conn, 30.0)  # TLS problems show here, in one line

        def client() -> GrpcClient | HttpClient:
            if args.http:
                return HttpClient(args.http, conn.token, 600.0, args.ignore_eos, verify=_https_context(args))
            return GrpcClient(conn, 600.0, args.ignore_eos)

        def level(*level_args, **kwargs):
            results, duration = asyncio.run(run_level(client(), *level_args, **kwargs))
            refused = refused_access(results, conn)
            if refused:
                raise connect.ConnectError(refused)
            return results, duration

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=False) as progress:
            levels = [None] if args.request_rate else args.levels
            for speculation in modes:
                if args.warmup:
                    level(prompts, args.warmup, args.max_new_tokens, speculation, args.warmup, None, args.seed)
            # Each level runs its modes back to back, and each repeat the other mode first: on a
            # shared machine whose speed drifts within minutes, a pair measured side by side is a
            # fair ratio, and a mode always run second would carry the drift as a bias.
            for repeat in range(args.repeats):
                for concurrency in levels:
                    for speculation in (modes if repeat % 2 == 0 else modes[::-1]):
                        n = args.num_requests or max(8, 2 * (concurrency or 4))
                        results, duration = level(prompts, n, args.max_new_tokens, speculation, concurrency,
                                                  args.request_rate or None, args.seed, progress)
                        report["runs"].append({"weights": weights, "speculation": speculation, "concurrency": concurrency,
                                               "request_rate": args.request_rate or None, "repeat": repeat,
                                               "num_requests": n, "requested_output_tokens": args.max_new_tokens,
                                               **summarise(results, duration), "_results": results})
                        if args.long_prompt_tokens:  # what the long prompts cost the others
                            short = [r for r in results if r.prompt_index % args.long_every != 0]
                            report["runs"][-1]["short_requests"] = summarise(short, duration)
                            long = [r for r in results if r.prompt_index % args.long_every == 0]
                            report["runs"][-1]["long_requests"] = {**summarise(long, duration), **long_prompts(long)}
                        save_partial(report, args.out)  # a long run killed later still leaves its numbers (main removes it at the end)
                        progress.console.print("\n".join(format_report({"runs": report["runs"][-1:]}).splitlines()[1:]))
            if overload and stack:
                offered = 4 * (args.max_concurrent_requests + args.max_queue)
                results, duration = level(prompts, offered, args.max_new_tokens, True, offered, None, args.seed, progress)
                report["overload"] = {"offered_concurrency": offered, "requested_output_tokens": args.max_new_tokens,
                                      "max_concurrent_requests": args.max_concurrent_requests,
                                      "max_queue": args.max_queue, **summarise(results, duration), "stack_alive": stack.alive(),
                                      "_results": results}
        if args.check:
            reference = reference_outputs(target, prompts, args.max_new_tokens, weights, args.device)
            same = _same_as(reference, tokenizer, text=bool(args.http), prefix=args.ignore_eos)
            for entry in [*(r for r in report["runs"] if r["weights"] == weights),
                          *([report["overload"]] if "overload" in report and overload else [])]:
                done = [r for r in entry["_results"] if r.ok]
                entry["identical"] = sum(same(r) for r in done)
                entry["mismatched"] = len(done) - entry["identical"]
    finally:
        if stack:
            stack.stop()


def _https_context(args: argparse.Namespace):
    """httpx's `verify` for --http: the system's CAs, or --tls-ca, with --tls-cert/--tls-key presented."""
    import ssl

    if not args.http.startswith("https://"):
        return True
    context = ssl.create_default_context(cafile=args.tls_ca or None)
    if args.tls_cert:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def _same_as(reference: list[list[int]], tokenizer, text: bool, prefix: bool):
    """Whether a response is the target's own output: its token ids (gRPC) or, over HTTP, which
    streams text, the reference decoded as the API decodes it (special tokens skipped). `prefix`
    (ignore_eos): the response goes on past the target's end-of-sequence, so only up to there."""
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference] if text else []

    def same(r: RequestResult) -> bool:
        if text:
            expected = decoded[r.prompt_index]
            return r.text.startswith(expected) if prefix else r.text == expected
        expected = reference[r.prompt_index]
        return r.tokens[: len(expected)] == expected if prefix else r.tokens == expected

    return same


def save_partial(report: dict, out: str) -> None:
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    runs = [{k: v for k, v in r.items() if k != "_results"} for r in report["runs"]]
    (folder / PARTIAL).write_text(json.dumps({**report, "runs": runs, "overload": None}, indent=2, default=str))


def headline(runs: list[dict]) -> dict:
    """Aggregate output tokens/s at the highest concurrency over one stream, per speculation mode
    (and weight format, when there are several); speculation's over speculation off's per level,
    from the pairs each repeat measured side by side (median, lowest, highest); and each format's
    over the first's, per mode and level. Repeated runs count by their median."""
    out = {}
    formats = list(dict.fromkeys(r.get("weights", "fp32") for r in runs))
    medians: dict[tuple, float] = {}
    for key in dict.fromkeys((r.get("weights", "fp32"), r["speculation"], r["concurrency"]) for r in runs if r["concurrency"]):
        medians[key] = statistics.median(r["output_throughput"] for r in runs
                                         if (r.get("weights", "fp32"), r["speculation"], r["concurrency"]) == key)
    for weights in formats:
        prefix = f"{weights}_" if len(formats) > 1 else ""
        for speculation in (True, False):
            by_level = {c: value for (w, s, c), value in medians.items() if (w, s) == (weights, speculation)}
            if 1 in by_level and len(by_level) > 1:
                top = max(by_level)
                out[f"{prefix}{'spec' if speculation else 'nospec'}_throughput_{top}_vs_1"] = by_level[top] / by_level[1] if by_level[1] else 0.0
        for level in dict.fromkeys(c for (w, _, c) in medians if w == weights):
            pairs = []
            for repeat in sorted({r.get("repeat", 0) for r in runs}):
                both = {r["speculation"]: r["output_throughput"] for r in runs
                        if (r.get("weights", "fp32"), r["concurrency"], r.get("repeat", 0)) == (weights, level, repeat)}
                if both.get(False) and True in both:
                    pairs.append(both[True] / both[False])
            if pairs:
                out[f"{prefix}spec_vs_off_{level}"] = statistics.median(pairs)
                if len(pairs) > 1:
                    out[f"{prefix}spec_vs_off_{level}_lowest"], out[f"{prefix}spec_vs_off_{level}_highest"] = min(pairs), max(pairs)
    for (weights, speculation, level), value in medians.items():
        first = medians.get((formats[0], speculation, level))
        if weights != formats[0] and first:
            out[f"{weights}_vs_{formats[0]}_{'spec' if speculation else 'nospec'}_{level}"] = value / first
    return out


def plot(report: dict, out: pathlib.Path) -> list[str]:
    """Latency percentiles and throughput against concurrency, speculation on vs off (the first
    repeat's runs: one line per mode; the summary has the repeats' ratios)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r["concurrency"] and r.get("repeat", 0) == 0]
    if not runs:
        return []
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2el")):
        for speculation, style in ((True, "-"), (False, "--")):
            rows = sorted((r for r in runs if r["speculation"] == speculation), key=lambda r: r["concurrency"])
            for stat in ("median", "p90", "p99"):
                if rows:
                    ax.plot([r["concurrency"] for r in rows], [r[f"{stat}_{metric}_ms"] for r in rows], style, marker="o",
                            label=f"{stat} {'spec' if speculation else 'no spec'}")
        ax.set(title=f"{metric.upper()} (ms)", xlabel="concurrent requests", xscale="log", xticks=report["config"]["levels"])
        ax.set_xticklabels([str(c) for c in report["config"]["levels"]])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_concurrency.png", dpi=110)
    written.append(str(out / "latency_vs_concurrency.png"))
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for speculation in (True, False):
        rows = sorted((r for r in runs if r["speculation"] == speculation), key=lambda r: r["concurrency"])
        if rows:
            ax.plot([r["concurrency"] for r in rows], [r["output_throughput"] for r in rows], marker="o",
                    label="speculation on" if speculation else "speculation off")
    ax.set(title="aggregate output tokens/s", xlabel="concurrent requests", ylabel="tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_concurrency.png", dpi=110)
    written.append(str(out / "throughput_vs_concurrency.png"))
    plt.close("all")
    return written


def format_lengths(run: dict) -> str:
    """`asked N: got n1 (k1), n2 (k2)`: the output lengths received, most requests first, so a run with
    --ignore-eos shows at a glance whether every request got exactly N; `~` marks lengths counted as
    content chunks because the server sent no usage."""
    lengths = run.get("output_lengths")
    if lengths is None:  # a report from before lengths were recorded
        return "-"
    counts = sorted(collections.Counter(lengths).items(), key=lambda kv: (-kv[1], kv[0]))
    approx = "~" if run.get("exact_lengths", len(lengths)) < len(lengths) else ""
    return f"{run.get('requested_output_tokens', '?')}: " + ", ".join(f"{approx}{n} ({k})" for n, k in counts[:6]) + (" ..." if len(counts) > 6 else "")


def lengthen(prompt: list[int], tokens: int) -> list[int]:
    """The prompt's ids repeated up to `tokens` ids (a long prompt of the same text)."""
    return (prompt * (tokens // max(1, len(prompt)) + 1))[:tokens]


def long_prompts(results: list[RequestResult]) -> dict:
    """How the long prompts of a mix fared as a group: whether they were prefilled (reached their
    first token) and finished in the order they were sent (the share of adjacent pairs that did;
    requests sent within the same instant may reach the server in either order), and the prompt
    tokens prefilled a second from the first one sent to the last one's first token (what a flood
    of long prompts gets from the target)."""
    done = sorted((r for r in results if r.ok), key=lambda r: r.sent)
    firsts, ends = [r.sent + r.ttft for r in done], [r.sent + r.e2el for r in done]
    pairs = len(done) - 1

    def in_order(times: list[float]) -> float:
        return sum(a <= b for a, b in zip(times, times[1:])) / pairs if pairs > 0 else 1.0

    span = max(firsts, default=0.0) - (done[0].sent if done else 0.0)
    return {"prefilled_in_order": in_order(firsts), "finished_in_order": in_order(ends),
            "prefill_tokens_per_s": sum(r.prompt_tokens for r in done) / span if span > 0 else 0.0}


def format_report(report: dict) -> str:
    lines = ["weights  spec  conc  done fail  req/s  out tok/s  TTFT p50/p99 ms   TPOT p50/p99 ms   ITL mean  E2EL p50/p99 ms  accept  identical"
             "  output tokens asked: got (requests)"]
    for r in [*report["runs"], *([report["overload"] | {"speculation": True, "concurrency": report["overload"]["offered_concurrency"]}]
                                 if "overload" in report else [])]:
        ident = f"{r['identical']}/{r['completed']}" if "identical" in r else "-"
        lines.append(
            f"{r.get('weights', 'fp32'):<7}  {'on ' if r['speculation'] else 'off'}  {r['concurrency'] or '-':>4}  {r['completed']:>4} {r['failed']:>4}  {r['request_throughput']:5.2f}"
            f"  {r['output_throughput']:9.1f}  {r['median_ttft_ms']:7.0f}/{r['p99_ttft_ms']:<7.0f}  {r['median_tpot_ms']:7.1f}/{r['p99_tpot_ms']:<7.1f}"
            f"  {r['mean_itl_ms']:8.1f}  {r['median_e2el_ms']:7.0f}/{r['p99_e2el_ms']:<7.0f}  {r['acceptance_rate']:6.2f}  {ident:>9}"
            f"  {format_lengths(r)}"
            + (f"  failures {r['failures']}" if r["failures"] else ""))
    for r in report["runs"]:
        if "short_requests" in r:
            q = r["short_requests"]
            lines.append(f"  short requests only ({'on ' if r['speculation'] else 'off'}, {r['concurrency']} concurrent): "
                         f"{q['completed']} done, TTFT p50/p99 {q['median_ttft_ms']:.0f}/{q['p99_ttft_ms']:.0f} ms, "
                         f"TPOT p50/p99 {q['median_tpot_ms']:.1f}/{q['p99_tpot_ms']:.1f} ms")
        if "long_requests" in r:
            q = r["long_requests"]
            lines.append(f"  long requests only: {q['completed']} done, TTFT p50/p99 {q['median_ttft_ms']:.0f}/{q['p99_ttft_ms']:.0f} ms, "
                         f"in the order sent (adjacent pairs): prefilled {q['prefilled_in_order']:.0%}, finished {q['finished_in_order']:.0%}, "
                         f"prefill {q['prefill_tokens_per_s']:.0f} tok/s")
    if "overload" in report:
        o = report["overload"]
        lines.append(f"overload: {o['offered_concurrency']} concurrent offered to max_concurrent_requests={o['max_concurrent_requests']} + "
                     f"max_queue={o['max_queue']}: {o['completed']} completed, refused {o['failures']}, slowest refusal "
                     f"{o['max_refusal_latency_ms']:.0f} ms, retry-after-ms {o['retry_after_ms'][:3]}, stack alive: {o['stack_alive']}")
    for key, value in report.get("summary", {}).items():
        lines.append(f"{key}: {value:.2f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        report = run(args)
    except ValueError as exc:
        print(f"specdec loadtest: {exc}", file=sys.stderr)
        return 2
    except connect.ConnectError as exc:
        print(f"specdec loadtest: {exc}", file=sys.stderr)
        return 1
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.json").write_text(json.dumps(report, indent=2))
    (out / PARTIAL).unlink(missing_ok=True)  # loadtest.json holds all of it now
    plots = plot(report, out)
    print(format_report(report))
    print(f"wrote {out / 'loadtest.json'}" + "".join(f", {p}" for p in plots))
    bad = sum(r.get("mismatched", 0) for r in [*report["runs"], *([report["overload"]] if "overload" in report else [])])
    return 1 if bad else 0
