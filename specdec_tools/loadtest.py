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

How one request is sent and timed is loadtest_clients.py; the summary, table and plots, loadtest_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import sys
import tempfile
import time

from specdec_tools import connect, flags
from specdec_tools.stacks import Stack
from specdec.model.formats import FORMATS
from specdec_tools.loadtest_clients import GrpcClient, HttpClient, RequestResult
from specdec_tools.loadtest_report import format_report, headline, long_prompts, plot, summarise
from specdec_tools.workload import load_prompt_ids, reference_outputs

PARTIAL = "loadtest.partial.json"  # in --out while a run goes on; removed once loadtest.json is written


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


def _cpu(stack: LocalStack | None) -> dict[str, float]:
    """CPU seconds so far of the local stack's services and of this process (the client)."""
    times = os.times()
    return {**(stack.cpu_seconds() if stack is not None else {}), "client": times.user + times.system}


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
                        before = _cpu(stack)
                        results, duration = level(prompts, n, args.max_new_tokens, speculation, concurrency,
                                                  args.request_rate or None, args.seed, progress)
                        report["runs"].append({"weights": weights, "speculation": speculation, "concurrency": concurrency,
                                               "request_rate": args.request_rate or None, "repeat": repeat,
                                               "num_requests": n, "requested_output_tokens": args.max_new_tokens,
                                               **summarise(results, duration), "_results": results})
                        tokens = report["runs"][-1]["total_output_tokens"]
                        if tokens:  # the serving path's cost, counted: CPU ms a token, by process
                            report["runs"][-1]["cpu_ms_per_token"] = {k: round(1e3 * (v - before.get(k, 0.0)) / tokens, 4)
                                                                      for k, v in _cpu(stack).items()}
                        if args.long_prompt_tokens:  # what the long prompts cost the others
                            short = [r for r in results if r.prompt_index % args.long_every != 0]
                            report["runs"][-1]["short_requests"] = summarise(short, duration)
                            long = [r for r in results if r.prompt_index % args.long_every == 0]
                            report["runs"][-1]["long_requests"] = {**summarise(long, duration), **long_prompts(long)}
                        save_partial(report, args.out)  # a long run killed later still leaves its numbers (main removes it at the end)
                        progress.console.print("\n".join(format_report({"runs": report["runs"][-1:]}).splitlines()[1:]))
                        if "cpu_ms_per_token" in report["runs"][-1]:
                            progress.console.print("   CPU ms a token: " + ", ".join(
                                f"{k} {v:.3f}" for k, v in report["runs"][-1]["cpu_ms_per_token"].items()))
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


def lengthen(prompt: list[int], tokens: int) -> list[int]:
    """The prompt's ids repeated up to `tokens` ids (a long prompt of the same text)."""
    return (prompt * (tokens // max(1, len(prompt)) + 1))[:tokens]


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
