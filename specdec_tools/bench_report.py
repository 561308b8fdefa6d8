"""What `specdec bench` prints and writes: the table, results.json and the PNG plots.

Kept apart from the runners so the numbers' definitions sit in one place:
- tokens/s of a repetition = tokens generated over all prompts / seconds over all prompts (end to
  end: prefill included, the client's clock for gRPC); min / median / max over repetitions.
- speed-ups compare medians of the same prompt set.
- predicted tokens/s (specdec_tools.plan) is for the decoding phase (after the first step: its tokens
  and time are the first token's, with any draft tokens verified beside the prompt), from the
  run's own acceptance and draft lengths, the draft's cost per token as the run spent it, the
  target's V(n) measured right before and after each of the configuration's passes (point-wise
  median; at a context of the prompt set's median prompt plus half the new tokens) and, over gRPC,
  the measured round trip; efficiency = measured decode tokens/s over predicted.
- TTFT = time to first token, median over the prompts and repetitions (specdec's rows: the
  loop's own clock, the coordinator's for gRPC).
- overhead = the share of the steps' time that is neither draft nor target compute: wire, gRPC,
  coordination and Python between the calls, on the loop's clock (the coordinator's for gRPC: from
  the request's first step to its last); beside it, per target pass (a token decoded ahead is a
  pass), wire + coordination in microseconds: the exchanges' wall less the services' compute, and
  the rest of the loop's time. request_overhead_share adds what a request costs around
  its steps (the client's call to the coordinator, the releases it waits for), on the client's clock.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys

from specdec_tools import plan as planlib


def _sum(samples, key: str) -> float:
    return sum((s.stats or {}).get(key, 0) for s in samples)


def _agreement(result, reference: dict[int, list[int]]) -> dict:
    """How many runs equal the reference tokens, and where the others first differ."""
    flat = [(i, s.tokens) for rep in result.samples for i, s in enumerate(rep)]
    first = [next((j for j, (a, b) in enumerate(zip(tokens, reference[i])) if a != b), min(len(tokens), len(reference[i])))
             for i, tokens in flat if tokens != reference[i]]
    return {"identical": len(flat) - len(first), "runs": len(flat), "first_difference_at": sorted(first)}


def summarise(result, baseline_tokens: dict[int, list[int]] | None, ctx: dict,
              reference_tokens: dict[int, list[int]] | None = None) -> dict:
    """One configuration on one prompt set -> the JSON record. `baseline_tokens`: what it must equal
    (the target alone in the same weight format); `reference_tokens`: fp32's greedy tokens, which a
    compact format or llama.cpp is compared with (agreement, not a guarantee)."""
    config = result.config
    per_rep = [sum(len(s.tokens) for s in rep) / sum(s.seconds for s in rep) for rep in result.samples]
    flat = [s for rep in result.samples for s in rep]
    record = {
        "configuration": config.name, "kind": config.kind, "drafter": config.drafter, "draft_length": config.draft_length,
        "adaptive": config.adaptive, "note": config.note, "prompt_set": result.prompt_set, "weights": config.weights,
        "tokens_per_second": {"min": min(per_rep), "median": statistics.median(per_rep), "max": max(per_rep), "per_repetition": per_rep},
        "tokens": sum(len(s.tokens) for s in flat), "seconds": sum(s.seconds for s in flat),
    }
    if baseline_tokens is not None:
        same = sum(1 for rep in result.samples for i, s in enumerate(rep) if s.tokens == baseline_tokens[i])
        record["identical_to_baseline"] = {"identical": same, "runs": len(flat)}
    if reference_tokens is not None:
        record["agreement_with_fp32"] = _agreement(result, reference_tokens)
    if flat and flat[0].stats is not None:
        steps, draft_steps = _sum(flat, "steps"), _sum(flat, "draft_steps")
        drafted, accepted = _sum(flat, "draft_tokens"), _sum(flat, "accepted_tokens")
        draft_s, verify_s, wire_s = _sum(flat, "draft_seconds"), _sum(flat, "verify_seconds"), _sum(flat, "wire_seconds")
        wall = record["seconds"]
        loop_s = _sum(flat, "total_seconds")
        positions = max((len(s.stats["accepted_per_position"]) for s in flat), default=0)
        by_position = [sum(s.stats["accepted_per_position"][i] for s in flat if i < len(s.stats["accepted_per_position"])) for i in range(positions)]
        record.update({
            "steps": steps, "draft_steps": draft_steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
            "accepted_by_position": [c / draft_steps for c in by_position] if draft_steps else [],
            "time_split": {"draft": draft_s / wall, "verify": verify_s / wall, "wire": wire_s / wall,
                           "other": max(0.0, wall - draft_s - verify_s - wire_s) / wall},
            "overhead_share": max(0.0, loop_s - draft_s - verify_s) / loop_s if loop_s else 0.0,
            # the same, per target pass: the exchanges' wire and the coordination between them
            "wire_per_step_seconds": wire_s / steps if steps else 0.0,
            "coordination_per_step_seconds": max(0.0, loop_s - draft_s - verify_s - wire_s) / steps if steps else 0.0,
            "request_overhead_share": max(0.0, wall - draft_s - verify_s) / wall,
            "wire_bytes_per_step": _sum(flat, "wire_bytes") / steps if steps else 0.0,
            "time_to_first_token_seconds": {"median": statistics.median(s.ttft for s in flat), "max": max(s.ttft for s in flat)},
        })
        if config.kind != "tree":  # the analytic model describes chains
            record.update(predict(record, flat, config, planlib.median_curve(result.curves), ctx))
    elif flat and all(s.ttft > 0 for s in flat):  # a peer that reports its first token (llama.cpp)
        record["time_to_first_token_seconds"] = {"median": statistics.median(s.ttft for s in flat), "max": max(s.ttft for s in flat)}
        # decoding apart from the prompt, counted as specdec's rows count it: the tokens after the first,
        # over the time after the first, so prompt processing weighs on neither side
        decode_seconds = sum(max(1e-9, s.seconds - s.ttft) for s in flat)
        record["decode_tokens_per_second"] = sum(max(0, len(s.tokens) - 1) for s in flat) / decode_seconds
    return record


def predict(record: dict, flat, config, curve: planlib.CostCurve, ctx: dict) -> dict:
    steps, draft_steps = record["steps"], record["draft_steps"]
    drafted, accepted = record["draft_tokens"], record["accepted_tokens"]
    mean_draft = drafted / draft_steps if draft_steps else 0.0
    acceptance = planlib.acceptance_from_steps(1 + accepted / draft_steps, mean_draft) if draft_steps else 0.0
    # The draft's cost per token as this run spent it: besides the tokens themselves that is the
    # draft's prefill of the prompt (after the first token for a feature draft, which waits for the
    # target's hidden states) and each step's catch-up on what the target accepted. The isolated
    # measurement (warm cache, no catch-up) is kept beside it: at g = 2 on the grounded prompts the
    # feature draft spent 2.6 ms a token against its 1.7 ms, and a model fed the latter predicted
    # 20% too fast.
    c = (record["time_split"]["draft"] * record["seconds"] / drafted) / curve.single if drafted else 0.0
    isolated = ctx["draft_cost"][config.drafter] / curve.single if config.drafter in ctx["draft_cost"] else None
    hops = config.hops
    prediction = planlib.predict_mix(acceptance, c, curve, mean_draft, draft_steps / steps if steps else 0.0, ctx["rtt"], hops)
    # After the first step (0 from a coordinator older than the field: then after the first token)
    decode_tokens = sum(max(0, s.stats["completion_tokens"] - max(1, s.stats["first_step_tokens"])) for s in flat)
    decode_seconds = sum(max(1e-9, s.stats["total_seconds"] - s.ttft) for s in flat)
    measured = decode_tokens / decode_seconds
    rows, best = planlib.plan_table(acceptance, c, curve, 16, ctx["rtt"], hops) if draft_steps else ([], 0)
    return {
        "model": {"acceptance_per_token": acceptance, "draft_cost_c": c, "draft_cost_c_isolated": isolated,
                  "mean_draft_length": mean_draft,
                  "drafting_share": draft_steps / steps if steps else 0.0, "hops": hops, "rtt_seconds": ctx["rtt"] if hops else 0.0,
                  "best_draft_length": best, "best_predicted_speedup": planlib.speedup(rows[best], curve) if rows else 1.0,
                  "cost_curve_seconds": {str(n): v for n, v in curve.points}},
        "decode_tokens_per_second": measured,
        "predicted_decode_tokens_per_second": prediction.tokens_per_second,
        "efficiency": measured / prediction.tokens_per_second,
    }


def report(results, ctx: dict, opts) -> dict:
    records = []
    for set_name in opts.prompt_sets:
        group = [r for r in results if r.prompt_set == set_name]

        def tokens_of(result) -> dict[int, list[int]] | None:
            return {i: s.tokens for i, s in enumerate(result.samples[0])} if result is not None else None

        # transformers' generate() (it computes with the fp32 weights and SDPA), else specdec-off in fp32
        reference = tokens_of(next((r for r in group if r.config.kind == "hf"), None)
                              or next((r for r in group if r.config.kind == "specdec-off" and r.config.weights == "fp32"), None))
        summaries = []
        for r in group:
            # every specdec row must equal the target engine decoding alone in its own weight format (specdec
            # computes attention row-exactly, and on a GPU in fixed-shape passes, so its bits differ from
            # generate()'s: that is agreement, shown for specdec-off and llama.cpp); assisted generation
            # must equal generate() itself
            own = tokens_of(next((o for o in group if o.config.kind == "specdec-off" and o.config.weights == r.config.weights
                                  and "numerics=fast" not in o.config.name), None))
            if r.config.kind in ("hf", "hf-assisted"):
                baseline = reference
            else:
                baseline = own if r.config.kind != "llamacpp" else None
            compare = reference if r.config.kind in ("specdec-off", "llamacpp") else None
            summaries.append(summarise(r, baseline, ctx, compare))
        hf = next((s for s in summaries if s["kind"] == "hf"), None)
        llama = next((s for s in summaries if s["configuration"] == "llama.cpp"), None)
        for s in summaries:
            median = s["tokens_per_second"]["median"]
            if hf is not None:
                s["speedup_vs_hf"] = median / hf["tokens_per_second"]["median"]
            if llama is not None:
                s["speedup_vs_llamacpp"] = median / llama["tokens_per_second"]["median"]
                if "decode_tokens_per_second" in s and "decode_tokens_per_second" in llama:
                    s["decode_speedup_vs_llamacpp"] = s["decode_tokens_per_second"] / llama["decode_tokens_per_second"]
            peer = next((p for p in summaries if p["kind"] == "hf-assisted" and p["drafter"] == s["drafter"]), None)
            if peer is not None and s["kind"].startswith("specdec"):
                s["speedup_vs_hf_assisted"] = median / peer["tokens_per_second"]["median"]
        records.extend(summaries)
    # the headline curves are the first weight format's target (each record's prediction used its own format's)
    first = [r for r in results if r.config.weights == opts.weights[0] or r.config.kind in ("hf", "hf-assisted", "llamacpp")]
    by_set = {name: planlib.median_curve([c for r in first if r.prompt_set == name for c in r.curves]) for name in opts.prompt_sets}
    document = {
        "command": ctx["command"], "machine": ctx["machine"], "target": ctx["target"], "drafters": ctx["drafters"],
        "options": {k: (str(v) if not isinstance(v, (int, float, bool, list, tuple, str)) else v) for k, v in dataclasses.asdict(opts).items()},
        "prompts": ctx["prompts"],
        "cost_curve_seconds": {str(n): v for n, v in planlib.median_curve([c for r in first for c in r.curves]).points},
        "cost_curve_seconds_by_set": {name: {str(n): v for n, v in c.points} for name, c in by_set.items()},
        "draft_cost_seconds_per_token": {k: v for k, v in ctx["draft_cost"].items()},
        "rtt_seconds": ctx["rtt"], "notes": ctx["notes"], "weights": ctx.get("weights", {}), "results": records,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "results.json").write_text(json.dumps(document, indent=2))
    print_table(document)
    plot(document, opts.out)
    print(f"\nwrote {opts.out / 'results.json'} and PNG plots in {opts.out}", file=sys.stderr)
    return document


def print_table(document: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 260)  # a log file gets every column
    curves = "; ".join(f"{name}: " + ", ".join(f"V({n})={v * 1e3:.1f}" for n, v in points.items())
                       for name, points in document["cost_curve_seconds_by_set"].items())
    console.print(f"[bold]{document['command']}[/bold]\nmachine: {document['machine']['cpu']} x{document['machine']['cores']}, "
                  f"torch {document['machine']['torch']}; target {document['target']}\ncost curve (ms, median of the run's): {curves}\n"
                  f"draft cost (ms/token): {', '.join(f'{k}={v * 1e3:.2f}' for k, v in document['draft_cost_seconds_per_token'].items()) or 'n/a'}; "
                  f"RTT {document['rtt_seconds'] * 1e3:.2f} ms")
    for name, held in document.get("weights", {}).items():
        stored = ", ".join(f"{k} x{v}" for k, v in held["stored_as"].items())
        console.print(f"weights {name}: {held['weight_bytes'] / 2**20:.0f} MiB of linear weights read per forward ({stored or 'as loaded'}), "
                      f"computing in {held.get('dtype', '?')} on {held.get('device', '?')}")
    for set_name in document["prompts"]:
        table = Table(title=f"prompt set: {set_name} ({len(document['prompts'][set_name])} prompts)")
        for column in ("configuration", "weights", "tok/s median [min-max]", "TTFT ms", "vs hf", "vs hf-assisted", "vs llama.cpp",
                       "identical", "agrees w/ fp32", "accept",
                       "tokens/step", "decode tok/s", "decode vs llama.cpp", "predicted", "efficiency", "draft/verify/wire/other %", "overhead",
                       "bytes/step"):
            table.add_column(column, justify="left" if column == "configuration" else "right")
        for r in (r for r in document["results"] if r["prompt_set"] == set_name):
            t = r["tokens_per_second"]
            ident = r.get("identical_to_baseline")
            agree = r.get("agreement_with_fp32")
            split = r.get("time_split")
            table.add_row(
                escape(r["configuration"]), escape(r.get("weights", "")), escape(f"{t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}]"),
                f"{r['time_to_first_token_seconds']['median'] * 1e3:.0f}" if "time_to_first_token_seconds" in r else "",
                f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else "",
                f"{r['speedup_vs_hf_assisted']:.2f}x" if "speedup_vs_hf_assisted" in r else "",
                f"{r['speedup_vs_llamacpp']:.2f}x" if "speedup_vs_llamacpp" in r else "",
                f"{ident['identical']}/{ident['runs']}" if ident else "",
                f"{agree['identical']}/{agree['runs']}" if agree else "",
                f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r and r["draft_tokens"] else "",
                f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "",
                f"{r['decode_tokens_per_second']:.1f}" if "decode_tokens_per_second" in r else "",
                f"{r['decode_speedup_vs_llamacpp']:.2f}x" if "decode_speedup_vs_llamacpp" in r else "",
                f"{r['predicted_decode_tokens_per_second']:.1f}" if "predicted_decode_tokens_per_second" in r else "",
                f"{r['efficiency']:.2f}" if "efficiency" in r else "",
                "/".join(f"{split[k] * 100:.0f}" for k in ("draft", "verify", "wire", "other")) if split else "",
                _overhead(r),
                f"{r['wire_bytes_per_step']:.0f}" if r.get("wire_bytes_per_step") else "",
            )
        console.print(table)
    for name, note in document["notes"].items():
        console.print(escape(f"note: {name}: {note}"))


def _overhead(r: dict) -> str:
    """The overhead column: its share of the steps' time, and per target pass wire + coordination in us."""
    if "overhead_share" not in r:
        return ""
    share = f"{r['overhead_share'] * 100:.1f}%"
    if "wire_per_step_seconds" not in r:  # results.json of an older run
        return share
    return f"{share} ({r['wire_per_step_seconds'] * 1e6:.0f}+{r['coordination_per_step_seconds'] * 1e6:.0f} us)"


def plot(document: dict, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(document["prompts"])
    results = document["results"]
    # 1. tokens/s per configuration, per prompt set, with the min-max range.
    fig, axes = plt.subplots(1, len(sets), figsize=(7 * len(sets), 5), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        rows = [r for r in results if r["prompt_set"] == set_name]
        medians = [r["tokens_per_second"]["median"] for r in rows]
        low = [m - r["tokens_per_second"]["min"] for m, r in zip(medians, rows)]
        high = [r["tokens_per_second"]["max"] - m for m, r in zip(medians, rows)]
        ax.barh([r["configuration"] for r in rows], medians, xerr=[low, high], color="tab:blue")
        ax.set_xlabel("tokens/s (greedy, end to end)")
        ax.set_title(set_name)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "tokens_per_second.png", dpi=110)
    plt.close(fig)
    # 2. speed-up over the target alone vs draft length: measured fixed lengths, and the prediction.
    fig, ax = plt.subplots(figsize=(7, 5))
    for set_name in sets:
        off = next(r for r in results if r["prompt_set"] == set_name and r["kind"] == "specdec-off")
        for drafter in {r["drafter"] for r in results if r["kind"] == "specdec-local"}:
            fixed = sorted((r for r in results if r["prompt_set"] == set_name and r["drafter"] == drafter
                            and r["kind"] == "specdec-local" and not r["adaptive"]), key=lambda r: r["draft_length"])
            if not fixed:
                continue
            gs = [r["draft_length"] for r in fixed]
            line = ax.plot(gs, [r["tokens_per_second"]["median"] / off["tokens_per_second"]["median"] for r in fixed], "o-",
                           label=f"{set_name}, {drafter}: measured")
            model = fixed[-1]["model"]
            curve = planlib.CostCurve(tuple((int(n), v) for n, v in model["cost_curve_seconds"].items()))
            rows, _ = planlib.plan_table(model["acceptance_per_token"], model["draft_cost_c"], curve, max(gs))
            ax.plot(range(len(rows)), [planlib.speedup(p, curve) for p in rows], "--", color=line[0].get_color(),
                    label=f"{set_name}, {drafter}: predicted (a={model['acceptance_per_token']:.2f})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("draft length g")
    ax.set_ylabel("speed-up over specdec-off")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_draft_length.png", dpi=110)
    plt.close(fig)
    # 3. acceptance by position (share of drafting steps whose i-th draft token was accepted).
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in results:
        if r.get("accepted_by_position") and r["kind"] in ("specdec-local", "specdec-grpc") and r["adaptive"]:
            ax.plot(range(1, len(r["accepted_by_position"]) + 1), r["accepted_by_position"], "o-",
                    label=f"{r['prompt_set']}: {r['configuration']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafting steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=110)
    plt.close(fig)
