"""The `specdec` command: run a service, start the local stack, or generate text.

    specdec serve target|draft|coordinator [flags]   one service (flags or SPECDEC_* env vars)
    specdec up [--drafter ngram|model] [...]         draft + target + coordinator on loopback
    specdec generate "PROMPT" [...]                  stream a completion from a coordinator
    specdec bench [--quick] [...]                    tokens/s against transformers and the analytic model
    specdec plan --acceptance A --cost-curve ...     predicted speed-up per draft length, and the best
    specdec loadtest [--quick] [--concurrency 1,2,4,8]  concurrent streams: throughput, TTFT/TPOT/ITL, overload
    specdec distill --out FOLDER [...]               train a pruned-vocabulary draft for a target (CPU)
    specdec config-table                             the configuration tables of docs/configuration.md
    specdec --version                                the package's version (also after any command)

The tools' flags (up, generate, bench, loadtest) take their defaults from SPECDEC_<FLAG> environment
variables (SPECDEC_ADDRESS for --address), as the services' from SPECDEC_<SERVICE>_<FLAG>; flags win.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import time

from specdec.model.formats import FORMATS
from specdec_tools import connect, flags

SERVICES = ("target", "draft", "coordinator")


def _service(name: str):
    """(config class, env prefix, serve coroutine) of a service, imported only when needed."""
    if name == "target":
        from target_service.config import ENV_PREFIX, TargetConfig
        from target_service.servicer import serve

        return TargetConfig, ENV_PREFIX, serve
    if name == "draft":
        from draft_service.config import ENV_PREFIX, DraftConfig
        from draft_service.servicer import serve

        return DraftConfig, ENV_PREFIX, serve
    from coordinator.config import ENV_PREFIX, CoordinatorConfig
    from coordinator.serve import serve

    return CoordinatorConfig, ENV_PREFIX, serve


def cmd_serve(argv: list[str]) -> int:
    if not argv or argv[0] not in SERVICES:
        print(f"usage: specdec serve {{{','.join(SERVICES)}}} [flags]  (--help after the name lists them)", file=sys.stderr)
        return 2
    from specdec.serving import config as cfg
    from specdec.serving.logs import configure

    cls, prefix, serve = _service(argv[0])
    from specdec.version import package_version

    config = cfg.from_argv(cls, argv[1:], prefix, prog=f"specdec serve {argv[0]}", version=package_version())
    configure(config.log_format, config.log_level)
    if argv[0] != "coordinator":  # the model services: torch's threads for the engine's worker only
        from specdec.serving.threads import confine

        confine(config.compute_threads)
    try:
        from specdec.serving.server import own_process, run_service

        own_process()  # this process is the service's: its heap is frozen once it serves (settle_heap)
        run_service(serve(config), config.event_loop)
    except (ValueError, OSError) as exc:  # a bad --model/--tokenizer, a busy port: the message, not a traceback
        print(f"specdec serve {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def default_drafter(target_model: str, draft_model: str = "") -> tuple[str, str]:
    """(drafter, draft model) for `specdec up --drafter auto`.

    A named draft model wins; the default target gets the pruned draft distilled for it when the
    checkout has one in models/; any other target gets the n-gram drafter, which needs no weights
    and is never slower than the target alone by more than its microseconds. The committed feature
    draft (smollm2-135m-feature) is not the default: over gRPC on 2 CPU cores it did not beat n-gram
    drafting on the demo prompt (docs/benchmarks.md); pass --draft-model smollm2-135m-feature for it.
    """
    from specdec.model.loading import DEFAULT_TARGET, DRAFT_ALIASES, _REPO_DRAFTS
    from specdec.model.draft_folders import is_pruned_draft

    if draft_model:
        return "model", draft_model
    alias = "smollm2-135m-draft"
    if target_model == DEFAULT_TARGET and is_pruned_draft(_REPO_DRAFTS / DRAFT_ALIASES[alias]):
        return "model", alias
    return "ngram", ""


def cmd_up(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec up", description="Start draft, target and coordinator on loopback, wait until all are healthy, and keep them running until Ctrl-C.")
    parser.add_argument("--target-model", default=None, help="Target model (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--drafter", default="auto", choices=("auto", "ngram", "model"),
                        help="auto: the n-gram drafter, or for the default target a pruned draft distilled into "
                             "specdec/drafts/smollm2-135m-draft (`specdec distill`, docs/distill.md; none is committed). "
                             "The committed feature draft (specdec/drafts/smollm2-135m-feature): --drafter model --draft-model smollm2-135m-feature.")
    parser.add_argument("--draft-model", default="", help="Draft model for --drafter model: alias (smollm2-135m-feature), folder or hub id.")
    parser.add_argument("--port", type=int, default=50051,
                        help="Coordinator port; the target takes port+1, the draft port+2 (replicas past the first take free ports).")
    parser.add_argument("--target-replicas", type=int, default=1,
                        help="Target services, each its own process; the coordinator routes each sequence to one of them.")
    parser.add_argument("--draft-replicas", type=int, default=1, help="Draft services, each its own process (as --target-replicas).")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--weights", default=None, choices=FORMATS,
                        help="What the target's kernel reads its weights as (`specdec serve target --weights`); gguf: the "
                             "embedded model's own 4-bit blocks, the model llama.cpp runs. Unset: the target's default.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds to wait for all three to be healthy.")
    parser.add_argument("--backend-token", default="", metavar="TOKEN",
                        help="The services' shared --backend-token (given to each through its environment); best set "
                             "through the environment itself, as a flag shows in `ps`. Empty: off.")
    flags.finish(parser)
    args = parser.parse_args(argv)
    if args.target_replicas < 1 or args.draft_replicas < 1:
        parser.error("--target-replicas and --draft-replicas must be >= 1")
    from specdec.model.loading import DEFAULT_TARGET
    from specdec.serving.config import check_backend_token
    from specdec_tools.stacks import Stack

    if args.drafter == "auto":
        args.drafter, args.draft_model = default_drafter(args.target_model or DEFAULT_TARGET, args.draft_model)
    try:
        check_backend_token(args.backend_token)
    except ValueError as exc:
        parser.error(str(exc))
    # on this terminal, with metrics and the HTTP API
    stack = Stack(args.target_model or "", None, args.device, grace=15.0, backend_token=args.backend_token.strip())
    signal.signal(signal.SIGTERM, lambda *_: (stack.stop(), sys.exit(0)))
    try:
        drafter = "ngram" if args.drafter == "ngram" else args.draft_model
        draft = stack.start_draft(drafter, port=args.port + 2, replicas=args.draft_replicas)
        stack.start_target(*(["--weights", args.weights] if args.weights else []),
                           *(stack.drafts_for_target(drafter, draft, args.draft_replicas) if args.target_replicas == 1 else []),
                           port=args.port + 1, replicas=args.target_replicas)
        coordinator = stack.start_coordinator(draft, port=args.port)
        stack.wait(args.timeout, announce=lambda role, address: print(f"specdec up: {role} healthy on {address}", file=sys.stderr, flush=True))
        print(f"specdec up: {_target_summary(stack.target_address.split(',')[0], stack.backend_token)}", file=sys.stderr, flush=True)
        print(f"specdec up: ready; coordinator on {coordinator} (Ctrl-C stops them all)", file=sys.stderr, flush=True)
        while stack.alive():
            time.sleep(0.5)
        print("specdec up: a service exited; stopping the others", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as exc:  # a service exited, or not healthy in time
        print(f"specdec up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec generate", description="Stream a completion from a running coordinator and print its statistics.")
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051", help="The coordinator's gRPC address.")
    parser.add_argument("--raw", action="store_true", help="Send the prompt as plain text instead of a chat message.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--draft-length", type=int, default=None, help="0 turns speculation off.")
    parser.add_argument("--no-adaptive", action="store_true")
    parser.add_argument("--tree-budget", type=int, default=None, help="Draft trees of at most this many nodes per step (0: chains); unset: the coordinator's default.")
    parser.add_argument("--tree-top-k", type=int, default=None, help="Children per expanded node of a dynamic tree.")
    parser.add_argument("--tree-shape", default=None, help="A static tree: children per node at each depth, e.g. 4,2,2,1.")
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--prediction", default="", help="Predicted output (text much of the answer repeats); @FILE reads it "
                        "from a file. Where the target drafts by prompt lookup it drafts from this too: faster, the same tokens.")
    parser.add_argument("--compare", action="store_true", help="Also generate twice with speculation off and once more with it (A B B A), report whether every run's tokens are identical and the speed-up over the two runs of each.")
    parser.add_argument("--wait", type=float, default=60.0, help="Seconds to wait for the coordinator to come up.")
    connect.add_arguments(parser)
    flags.finish(parser)
    args = parser.parse_args(argv)
    try:
        conn = connect.Connection.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    import grpc

    from protos import specdec_pb2 as pb
    from protos import specdec_pb2_grpc as pb_grpc

    prediction = args.prediction
    if prediction.startswith("@"):
        try:
            prediction = pathlib.Path(prediction[1:]).read_text()
        except OSError as exc:
            parser.error(f"--prediction {args.prediction}: {exc.strerror}")

    def build(draft_length):
        request = pb.GenerateStreamRequest(max_new_tokens=args.max_new_tokens, stop=args.stop, prediction=prediction)
        if args.raw:
            request.text = args.prompt
        else:
            request.chat.messages.add(role="user", content=args.prompt)
        request.sampling.temperature = args.temperature
        for field in ("top_k", "top_p", "seed"):
            if getattr(args, field) is not None:
                setattr(request.sampling, field, getattr(args, field))
        if draft_length is not None:
            request.speculation.draft_length = draft_length
        if args.no_adaptive:
            request.speculation.adaptive = False
        if args.tree_budget is not None:
            request.speculation.tree_budget = args.tree_budget
        if args.tree_top_k is not None:
            request.speculation.tree_top_k = args.tree_top_k
        if args.tree_shape:
            request.speculation.tree_shape.extend(int(part) for part in args.tree_shape.split(","))
        return request

    def run(stub, request, echo: bool):
        tokens, stats, finish = [], None, None
        for message in stub.GenerateStream(request, wait_for_ready=True, timeout=args.wait + 600, metadata=conn.metadata):
            tokens.extend(message.token_ids)
            if echo and message.text:
                print(message.text, end="", flush=True)
            if message.HasField("stats"):
                stats, finish = message.stats, message.finish_reason
        if echo:
            print()
        return tokens, stats, finish

    try:  # SERVING only once the models are loaded and warmed; the same credentials as the calls
        connect.wait_healthy(conn, args.wait)
    except connect.ConnectError as exc:
        print(f"specdec generate: {exc}", file=sys.stderr)
        return 1
    with conn.channel() as channel:
        stub = pb_grpc.CoordinatorServiceStub(channel)
        try:
            tokens, stats, finish = run(stub, build(args.draft_length), echo=True)
        except grpc.RpcError as exc:
            print(f"specdec generate: {connect.describe(exc, conn)}", file=sys.stderr)
            return 1
        print(_format_stats(stats, pb.FinishReason.Name(finish)), file=sys.stderr)
        if args.compare:
            # Target alone twice, then speculation once more (A B B A): a machine that drifts
            # within seconds (a shared 2-core VM: +-15%) then weighs on both sides alike. One
            # pair had put the same request anywhere from 0.74x to 1.15x.
            plain = [run(stub, build(0), echo=False) for _ in range(2)]
            again = run(stub, build(args.draft_length), echo=False)
            same = all(t == tokens for t, _, _ in (*plain, again))
            spec_s = stats.total_seconds + again[1].total_seconds
            plain_s = sum(p[1].total_seconds for p in plain)
            speedup = plain_s / spec_s if spec_s else float("nan")
            print(f"target alone: {len(plain[0][0])} tokens in {plain[0][1].total_seconds:.2f}s and {plain[1][1].total_seconds:.2f}s, "
                  f"speculative again in {again[1].total_seconds:.2f}s; identical tokens: {'yes' if same else 'NO'}; "
                  f"speed-up {speedup:.2f}x (the two runs of each, interleaved)", file=sys.stderr)
            if not same and args.temperature == 0:
                return 3
    return 0


def _target_summary(address: str, token: str = "") -> str:
    """What the target serves, in the terms a user chooses it by (--weights, --device): the model's
    tokens depend on the format, so the demo says which one it ran."""
    import grpc

    from protos import specdec_pb2 as pb
    from protos import specdec_pb2_grpc as pb_grpc
    from specdec.serving.backend_auth import call_metadata

    try:
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.TargetServiceStub(channel).GetInfo(pb.TargetServiceGetInfoRequest(), timeout=10,
                                                              metadata=call_metadata(token)).info
    except grpc.RpcError as exc:
        return f"target on {address} (its model info did not come: {exc.code().name})"
    why = {"gguf-a8": "its GGUF blocks against 8-bit activations, the fastest exact format on this CPU; "
                      "--weights fp32 for the tokens of transformers' generate()",
           "fp32": "float32, the tokens of transformers' generate()"}.get(info.weights, "as --weights asked")
    return f"target {info.model} on {info.device}, weights {info.weights} ({why})"


def _format_stats(stats, finish: str) -> str:
    rate = stats.completion_tokens / stats.total_seconds if stats.total_seconds else 0.0
    return (
        f"[{finish.removeprefix('FINISH_REASON_').lower()}] {stats.completion_tokens} tokens in {stats.total_seconds:.2f}s "
        f"({rate:.1f} tok/s, first token {stats.time_to_first_token_seconds * 1000:.0f} ms); "
        f"steps {stats.steps}, drafted {stats.draft_tokens}, accepted {stats.accepted_tokens} "
        f"(rate {stats.acceptance_rate:.2f}, {stats.mean_accepted_length:.2f} tokens/step); "
        f"time draft {stats.draft_seconds:.2f}s verify {stats.verify_seconds:.2f}s wire {stats.wire_seconds:.2f}s; "
        f"{stats.wire_bytes} wire bytes"
    )


def cmd_config_table(argv: list[str]) -> int:
    from specdec.serving.config import markdown_table

    for name in SERVICES:
        cls, prefix, _ = _service(name)
        print(f"### `specdec serve {name}`\n\n{markdown_table(cls, prefix)}\n")
    return 0


def cmd_bench(argv: list[str]) -> int:
    from specdec_tools.bench import main as bench_main

    return bench_main(argv)


def cmd_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="specdec plan",
        description="Predict tokens per step and speed-up for each draft length (Leviathan et al.), and name the best.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--acceptance", type=float, required=True, help="Per-token acceptance a in [0, 1].")
    parser.add_argument("--draft-cost", type=float, default=0.1, help="Draft cost per token c, relative to one target decoding step V(1).")
    parser.add_argument("--cost-curve", default="", help="Target V(n) in ms as n:ms pairs, e.g. 1:44,2:70,4:67,8:70,16:85 (the analytic model and how to measure V(n): docs/benchmarks.md).")
    parser.add_argument("--measure", default="", help="Measure V(n) on this machine with this target model instead (alias/folder/hub id).")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="Network round trip per hop, ms.")
    parser.add_argument("--hops", type=int, default=2, help="Round trips per step (2: draft and target over gRPC; 0: one process).")
    parser.add_argument("--max-draft", type=int, default=16)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    args = parser.parse_args(argv)
    from specdec_tools import plan

    if bool(args.cost_curve) == bool(args.measure):
        parser.error("give exactly one of --cost-curve and --measure")
    try:
        if args.measure:
            from specdec_tools.bench import measure_cost_curve
            from specdec.model.assembly import LMOptions, load_lm

            lm = load_lm(LMOptions(model=args.measure, device="cpu")).lm  # as the target service runs it (fp32)
            context = list(range(100, 356))  # 256 tokens of context
            curve = measure_cost_curve(lm, context, sorted({*range(1, 10), 12, 16, args.max_draft + 1}))
            print("measured V(n), ms: " + ", ".join(f"{n}:{v * 1e3:.1f}" for n, v in curve.points))
        else:
            curve = plan.CostCurve.parse(args.cost_curve)
        rows, best = plan.plan_table(args.acceptance, args.draft_cost, curve, args.max_draft, args.rtt_ms / 1e3, args.hops)
    except ValueError as e:
        parser.error(str(e))
    print(plan.format_plan(rows, best, curve))
    print(f"best draft length: {best} ({plan.speedup(rows[best], curve):.2f}x over the target alone)")
    return 0


def cmd_loadtest(argv: list[str]) -> int:
    from specdec_tools.loadtest import main as loadtest_main

    return loadtest_main(argv)


def cmd_distill(argv: list[str]) -> int:
    from specdec_tools.distill import main as distill_main

    return distill_main(argv)


COMMANDS = {"distill": cmd_distill, "serve": cmd_serve, "up": cmd_up, "generate": cmd_generate, "config-table": cmd_config_table,
            "bench": cmd_bench, "plan": cmd_plan, "loadtest": cmd_loadtest}


def _version() -> str:
    from specdec.version import package_version

    return package_version()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "torch" not in sys.modules:
        from specdec.serving.openmp import bounded_spin

        bounded_spin()
    if argv and argv[0] in ("--version", "-V"):
        print(f"specdec {_version()}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
