"""`specdec bench --overlap`: sequential against overlapped speculation, draft and target pinned apart.

With a model draft the target asks the draft itself (drafted runs): "overlapped" is then a pipelined
run, the draft drafting the next step during the target's pass. The coordinator's run-ahead
statistics stay 0 there (the bets are the target's), so the hit columns read 0.

Overlapped speculation (coordinator/policy/overlap.py) only pays where the draft and the target compute
at the same time on different hardware. Here that is two CPU cores: the target service runs pinned
to one core, the draft service to the other (one torch thread each), in BOTH modes, so the
sequential schedule gets exactly the same hardware as the overlapped one. Three coordinators share
those two services: speculation off (the target alone: the reference tokens and the baseline),
sequential (`--overlap off`) and overlapped (`--overlap on`). Every draft length runs both
schedules on the same prompts, repetitions interleaved; it prints tokens/s, the ratio, the share of
run-ahead work used, and the analytic model's prediction (specdec_tools.plan.predict_overlap, from the
sequential run's own acceptance and step times) beside the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

from specdec_tools import flags
from specdec_tools import plan as planlib
from specdec_tools.bench_runners import grpc_runner, machine, quick_models
from specdec_tools.stacks import Stack
from specdec_tools.workload import PROMPT_SETS, PROMPTS_DIR, load_prompts, prompt_path

MODES = ("off", "sequential", "overlapped")


class PinnedStack(Stack):
    """Target on one core, draft (and the coordinators: light, mostly waiting) on the other."""

    def __init__(self, target: str, drafter: str, logs: pathlib.Path, cores: tuple[int, int] | None):
        super().__init__(target, logs, "cpu")
        target_core, draft_core = cores if cores else (None, None)
        draft_address = self.start_draft(drafter, core=draft_core)
        # a model draft is the target's own (--draft): both schedules are drafted runs, the target
        # asking the draft each step, plain or pipelined (target_service/runs.py)
        self.start_target(*self.drafts_for_target(drafter, draft_address), core=target_core)
        self.coordinators = {
            "off": self.start_coordinator("", core=draft_core),
            "sequential": self.start_coordinator(draft_address, "--overlap", "off", core=draft_core),
            "overlapped": self.start_coordinator(draft_address, "--overlap", "on", core=draft_core),
        }
        self.wait()


_TOTALS = ("steps", "draft_steps", "draft_tokens", "accepted_tokens", "completion_tokens", "draft_seconds", "verify_seconds",
           "wire_seconds", "runahead_steps", "runahead_hits", "runahead_tokens", "runahead_used_tokens")


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def summarise(samples_by_rep: list[list], reference: list[list[int]]) -> dict:
    """One (draft length, mode): tokens/s per repetition (all prompts' tokens over their seconds)."""
    rates = [sum(len(s.tokens) for s in rep) / sum(s.seconds for s in rep) for rep in samples_by_rep]
    flat = [s for rep in samples_by_rep for s in rep]
    identical = sum(1 for rep in samples_by_rep for s, ref in zip(rep, reference) if s.tokens == ref)
    t = {key: sum(s.stats[key] for s in flat) for key in _TOTALS}
    return {
        "tokens_per_second": {"min": min(rates), "median": statistics.median(rates), "max": max(rates)},
        "identical": {"identical": identical, "runs": len(flat)},
        "steps": t["steps"], "draft_tokens": t["draft_tokens"], "accepted_tokens": t["accepted_tokens"],
        "tokens_per_step": _ratio(t["completion_tokens"], t["steps"]),
        "draft_seconds_per_token": _ratio(t["draft_seconds"], t["draft_tokens"]),
        "draft_tokens_per_drafting_step": _ratio(t["draft_tokens"], t["draft_steps"]),
        "draft_seconds_per_drafting_step": _ratio(t["draft_seconds"], t["draft_steps"]),
        "verify_seconds_per_step": _ratio(t["verify_seconds"], t["steps"]),
        "wire_seconds_per_step": _ratio(t["wire_seconds"], t["steps"]),
        "runahead_steps": t["runahead_steps"], "runahead_hits": t["runahead_hits"],
        "runahead_tokens": t["runahead_tokens"], "runahead_used_tokens": t["runahead_used_tokens"],
        "runahead_used_share": _ratio(t["runahead_used_tokens"], t["runahead_tokens"]),
        "hit_rate": _ratio(t["runahead_hits"], t["runahead_steps"]),
    }


def predict(sequential: dict, draft_length: int, costs: tuple[float, float]) -> planlib.OverlapPrediction:
    """From the sequential run alone: its acceptance and step times, and the draft's catch-up and
    per-token costs fitted over every draft length of the prompt set (`costs`)."""
    acceptance = planlib.acceptance_from_steps(sequential["tokens_per_step"], draft_length)
    catch_up, per_token = costs
    return planlib.predict_overlap(acceptance, draft_length, per_token, sequential["verify_seconds_per_step"],
                                   sequential["wire_seconds_per_step"], catch_up)


def run(args) -> dict:
    from specdec.model.loading import load_tokenizer

    cores = None
    available = sorted(os.sched_getaffinity(0))
    if len(available) >= 2 and not args.no_pin:
        cores = (available[0], available[1])
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = args.target_model, args.drafter
        if args.quick:
            target, drafter = quick_models(pathlib.Path(tmp), noise=0.02)
        tokenizer = load_tokenizer(target)
        prompts = {name: load_prompts(tokenizer, name, args.limit) for name in args.prompts}
        stack = PinnedStack(target, drafter, args.out / "logs", cores)
        try:
            runners = {(g, mode): grpc_runner(stack.coordinators[mode], args.max_new_tokens, g, False)
                       for g in args.draft_lengths for mode in MODES if mode != "off" or g == args.draft_lengths[0]}
            by_set: dict[tuple, list[list]] = {}  # (prompt set, g, mode) -> [repetition][prompt]
            for items in prompts.values():
                for _, prompt in items[:1]:  # warm-up: first calls pay for connections and allocations
                    for runner in runners.values():
                        runner(prompt)
            for rep in range(args.repeats):
                for name, items in prompts.items():
                    for key, runner in runners.items():
                        by_set.setdefault((name, *key), []).append([runner(prompt) for _, prompt in items])
                print(f"repetition {rep + 1}/{args.repeats} done", flush=True)
        finally:
            stack.stop()
    rows = []
    for name in prompts:
        baseline = by_set[(name, args.draft_lengths[0], "off")]
        reference = [s.tokens for s in baseline[0]]
        alone = summarise(baseline, reference)
        sequential = {g: summarise(by_set[(name, g, "sequential")], reference) for g in args.draft_lengths}
        costs = planlib.fit_draft_costs([(s["draft_tokens_per_drafting_step"], s["draft_seconds_per_drafting_step"])
                                         for s in sequential.values()])
        for g in args.draft_lengths:
            seq = sequential[g]
            ovl = summarise(by_set[(name, g, "overlapped")], reference)
            prediction = predict(seq, g, costs)
            measured = ovl["tokens_per_second"]["median"] / seq["tokens_per_second"]["median"]
            rows.append({"prompt_set": name, "draft_length": g, "target_alone": alone, "sequential": seq, "overlapped": ovl,
                         "draft_catch_up_seconds": costs[0], "draft_seconds_per_token": costs[1],
                         "overlapped_vs_sequential": measured, "predicted_overlapped_vs_sequential": prediction.speedup,
                         "predicted_hit_rate": prediction.hit_rate, "efficiency": measured / prediction.speedup})
    return {"machine": machine(), "pinned_cores": {"target": cores[0], "draft_and_coordinators": cores[1]} if cores else None,
            "target": "tiny (quick)" if args.quick else args.target_model, "drafter": "tiny (quick)" if args.quick else args.drafter,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "command": "specdec bench " + " ".join(args.argv),
            "rows": rows}


def print_table(document: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    pinned = document["pinned_cores"]
    where = (f"target on core {pinned['target']}, draft + coordinators on core {pinned['draft_and_coordinators']}"
             if pinned else "not pinned")
    table = Table(title=f"sequential vs overlapped speculation ({where}; greedy; tok/s medians over repetitions)")
    for column in ("prompts", "g", "target alone", "sequential", "overlapped", "ratio", "predicted", "efficiency",
                   "tokens/step", "hit rate (pred.)", "run-ahead used", "identical"):
        table.add_column(column, justify="left" if column == "prompts" else "right")
    for r in document["rows"]:
        seq, ovl = r["sequential"], r["overlapped"]
        ident = [x["identical"] for x in (seq, ovl)]
        table.add_row(r["prompt_set"], str(r["draft_length"]), f"{r['target_alone']['tokens_per_second']['median']:.1f}",
                      f"{seq['tokens_per_second']['median']:.1f}", f"{ovl['tokens_per_second']['median']:.1f}",
                      f"{r['overlapped_vs_sequential']:.2f}x", f"{r['predicted_overlapped_vs_sequential']:.2f}x",
                      f"{r['efficiency']:.2f}", f"{seq['tokens_per_step']:.2f}",
                      f"{ovl['hit_rate']:.2f} ({r['predicted_hit_rate']:.2f})", f"{ovl['runahead_used_share']:.0%}",
                      f"{sum(i['identical'] for i in ident)}/{sum(i['runs'] for i in ident)}")
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def main(argv: list[str]) -> int:
    from specdec.model.loading import DEFAULT_TARGET

    parser = argparse.ArgumentParser(prog="specdec bench --overlap", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--overlap", action="store_true", help="This comparison (the flag that selects it).")
    parser.add_argument("--target-model", default=DEFAULT_TARGET, help="Target model: alias, folder, .gguf or hub id.")
    flags.deprecated_alias(parser, "--target", "target_model", "--target-model")
    parser.add_argument("--drafter", default="ngram", help="'ngram' or a draft model (alias / folder / hub id).")
    parser.add_argument("--prompts", default="chat", help=f"Comma-separated prompt sets from {PROMPTS_DIR}.")
    parser.add_argument("--limit", type=int, default=4, help="Use only the first N prompts of each set (0: all).")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="Interleaved repetitions.")
    parser.add_argument("--draft-lengths", default="1,2,4", help="Fixed draft lengths, each run in both schedules.")
    parser.add_argument("--no-pin", action="store_true", help="Do not pin the services to separate cores.")
    parser.add_argument("--out", default=None,
                        help=f"Folder for overlap.json and the services' logs; default: a new {flags.RESULTS_ROOT}/overlap-TIMESTAMP/.")
    parser.add_argument("--quick", action="store_true", help="Tiny random models, 2 prompts, 16 tokens, 1 repetition.")
    flags.finish(parser)
    args = parser.parse_args(argv)
    try:
        args.draft_lengths = tuple(int(x) for x in args.draft_lengths.split(",") if x.strip())
    except ValueError:
        parser.error(f"--draft-lengths: expected comma-separated integers, got {args.draft_lengths!r}")
    if not args.draft_lengths or any(not 1 <= g <= 32 for g in args.draft_lengths):
        parser.error("--draft-lengths must name lengths in 1..32")
    args.prompts = tuple(s.strip() for s in args.prompts.split(",") if s.strip())
    for name in args.prompts:
        if name not in PROMPT_SETS and not prompt_path(name).is_file():
            parser.error(f"--prompts: no prompt set {name!r} in {PROMPTS_DIR}")
    if args.repeats < 1 or args.max_new_tokens < 1 or args.limit < 0:
        parser.error("--repeats and --max-new-tokens must be >= 1, --limit >= 0")
    if args.quick:
        args.limit, args.max_new_tokens, args.repeats = min(args.limit or 2, 2), min(args.max_new_tokens, 16), 1
    args.out = pathlib.Path(args.out or flags.fresh_out("overlap"))
    args.argv = argv
    document = run(args)
    print_table(document)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(document, indent=2))
    print(f"wrote {args.out / 'overlap.json'}")
    return 0
