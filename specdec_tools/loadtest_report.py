"""`specdec loadtest`'s report: percentiles and a level's summary (vLLM's benchmark_serving names),
the headline ratios (speculation on over off, each level over one stream), the long prompts of a
mix, the table printed, and the plots.

Apart from loadtest.py (the run) because a report is read from a loadtest.json as much as made
from a run.
"""

from __future__ import annotations

import collections
import pathlib
import statistics

from specdec_tools.loadtest_clients import RequestResult


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
