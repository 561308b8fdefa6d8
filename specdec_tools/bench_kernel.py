"""`specdec bench --kernel`: how close each weight format's decode step comes to the memory's speed.

A decode step reads every linear layer's weights once; its floor is those bytes over the machine's
read bandwidth. This times the kernel calls of the target's own linear layers (every one, in
order, as a forward makes them: one call per group of siblings; attention and the rest of the model
left out) at 1 row (a decode step) and at a verify's and a batch's row counts, for each format,
and sets the GB/s of weights read against the bandwidth the same kernel's vector loop reaches
summing a buffer far larger than the caches (`Kernel.read`). The same layers called through their
modules (the Python around each call included) are timed beside. Medians of interleaved
repetitions: drift on a shared machine hits every format alike.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from specdec.model.cpu import gemm, gemm_kernel
from specdec.model.formats import FORMATS
from specdec_tools import flags


def read_bandwidth(kernel: gemm_kernel.Kernel, gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second the kernel's loop reads from memory (median of `repeats`, after a warm-up)."""
    n = int(gib * 2**30) // 4 // 64 * 64
    raw = torch.ones(n + 16)
    buffer = raw[(-raw.data_ptr() % 64) // 4:][:n]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        kernel.read(buffer)
        times.append(time.perf_counter() - start)
    return n * 4 / statistics.median(times[1:])


def layers_of(target: str, weights: str) -> tuple[list[gemm.PackedLinear], gemm.PackReport]:
    from specdec.model.assembly import LMOptions, load_lm

    served = load_lm(LMOptions(model=target, device="cpu", weights=weights, packed_gemm_min_rows=1))
    report = served.packed
    seen: dict[int, gemm.PackedLinear] = {}
    for module in served.loaded.model.modules():
        if isinstance(module, gemm.PackedLinear):
            seen.setdefault(id(module), module)
    return list(seen.values()), report


def kernel_calls(layers: list[gemm.PackedLinear], rows: int) -> list:
    """The kernel calls one forward's linear layers make, bound to fixed inputs and outputs: one per
    layer, or per group of siblings (gemm.LinearGroup). Timing them alone measures what reading the
    weights costs, without the Python around each call."""
    kernel = layers[0].kernel
    held: list[torch.Tensor] = []  # inputs and outputs stay alive while the calls run

    def tensor(*shape: int) -> torch.Tensor:
        held.append(torch.randn(*shape))
        return held[-1]

    calls, seen = [], set()
    for layer in layers:
        x = tensor(rows, layer.in_features)
        if layer.group is not None:
            if id(layer.group) in seen:
                continue
            seen.add(id(layer.group))
            w, parts = layer.group.weight, layer.group.parts
            calls.append((kernel._parts, (w.code, x.data_ptr(), rows, w.in_features, w.panels.data_ptr(),
                                          None if w.scales is None else w.scales.data_ptr(),
                                          None if w.mins is None else w.mins.data_ptr(), parts.count, parts.sizes,
                                          tensor(rows * parts.total).data_ptr(), parts.biases)))
        elif layer.compact is not None:  # the call PackedLinear.forward makes, with its bound pointers
            calls.append((kernel._linear_c, (layer.compact.code, x.data_ptr(), rows, layer.in_features, *layer._pointers,
                                             tensor(rows, layer.out_features).data_ptr())))
        else:
            calls.append((kernel._linear, (x.data_ptr(), rows, layer.in_features, layer.packed.data_ptr(),
                                           layer.out_features, None, tensor(rows, layer.out_features).data_ptr())))
    return [calls, held]


def time_calls(calls: list) -> float:
    start = time.perf_counter()
    for fn, args in calls[0]:
        fn(*args)
    return time.perf_counter() - start


def time_layers(layers: list[gemm.PackedLinear], rows: int) -> float:
    inputs = {k: torch.randn(rows, k) for k in {layer.in_features for layer in layers}}
    start = time.perf_counter()
    with torch.inference_mode():
        for layer in layers:
            layer(inputs[layer.in_features])
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench --kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", action="store_true", help="This comparison (the flag that selects it).")
    parser.add_argument("--target-model", default="smollm2-135m-instruct", help="Target model: alias, folder, .gguf or hub id.")
    parser.add_argument("--weights", default="fp32,bf16,int8,q4,gguf,gguf-a8", help=f"Comma-separated formats from {', '.join(FORMATS)}.")
    parser.add_argument("--rows", default="1,2,4,9,16,64", help="Row counts to time (1: a decode step).")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None, help=f"Folder for kernel.json; default: a new {flags.RESULTS_ROOT}/kernel-TIMESTAMP/.")
    flags.finish(parser)
    args = parser.parse_args(argv)
    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not formats or any(w not in FORMATS for w in formats):
        parser.error(f"--weights: comma-separated formats from {', '.join(FORMATS)}")
    try:
        row_counts = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        parser.error("--rows: comma-separated integers")
    kernel = gemm_kernel.load()
    if kernel is None or not gemm.available(torch.device("cpu"), torch.float32):
        print("specdec bench --kernel: the kernel could not be built here (no C compiler?)", file=sys.stderr)
        return 1
    print("measuring the memory's read bandwidth", file=sys.stderr, flush=True)
    bandwidth = read_bandwidth(kernel)
    held = {}
    for weights in formats:
        print(f"loading {args.target_model} as {weights}", file=sys.stderr, flush=True)
        try:
            held[weights] = layers_of(args.target_model, weights)
        except ValueError as exc:
            print(f"  skipped: {exc}", file=sys.stderr)
    times: dict[tuple[str, int], list[float]] = {(w, r): [] for w in held for r in row_counts}
    layer_times: dict[tuple[str, int], list[float]] = {(w, r): [] for w in held for r in row_counts}
    bound = {(w, r): kernel_calls(layers, r) for w, (layers, _) in held.items() for r in row_counts}
    for rep in range(args.repeats + 1):
        for rows in row_counts:
            for weights, (layers, _) in held.items():
                elapsed, through_layers = time_calls(bound[(weights, rows)]), time_layers(layers, rows)
                if rep:
                    times[(weights, rows)].append(elapsed)
                    layer_times[(weights, rows)].append(through_layers)
    records = []
    for weights, (layers, report) in held.items():
        for rows in row_counts:
            seconds = statistics.median(times[(weights, rows)])
            records.append({"weights": weights, "rows": rows, "layers": len(layers), "kernel_calls": len(bound[(weights, rows)][0]),
                            "weight_bytes": report.weight_bytes, "stored_as": report.sources, "seconds": seconds,
                            "gb_per_s": report.weight_bytes / seconds / 1e9,
                            "share_of_bandwidth": report.weight_bytes / seconds / bandwidth,
                            "seconds_through_layers": statistics.median(layer_times[(weights, rows)])})
    document = {"command": "specdec bench " + " ".join(argv), "target": args.target_model,
                "read_bandwidth_gb_per_s": bandwidth / 1e9, "results": records}
    out = pathlib.Path(args.out or flags.fresh_out("kernel"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel.json").write_text(json.dumps(document, indent=2))
    print_table(document)
    print(f"wrote {out / 'kernel.json'}", file=sys.stderr)
    return 0


def print_table(document: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"[bold]{document['command']}[/bold]\n{document['target']}: the kernel's read loop reaches "
                  f"{document['read_bandwidth_gb_per_s']:.1f} GB/s on this machine")
    rows = sorted({r["rows"] for r in document["results"]})
    table = Table(title="the kernel calls of one forward's linear layers: ms (GB/s of weights read, share of the read "
                        "bandwidth); below it, through the layers' Python calls")
    table.add_column("weights")
    table.add_column("MiB read", justify="right")
    for n in rows:
        table.add_column(f"{n} row{'s' if n > 1 else ''}", justify="right")
    by_format: dict[str, list[dict]] = {}
    for r in document["results"]:
        by_format.setdefault(r["weights"], []).append(r)
    fp32 = {r["rows"]: r["seconds"] for r in by_format.get("fp32", [])}
    for weights, records in by_format.items():
        cells = []
        for r in sorted(records, key=lambda r: r["rows"]):
            ratio = f", {fp32[r['rows']] / r['seconds']:.2f}x fp32" if fp32 and weights != "fp32" else ""
            cells.append(f"{r['seconds'] * 1e3:.1f} ({r['gb_per_s']:.1f} GB/s, {r['share_of_bandwidth']:.0%}{ratio})\n"
                         f"{r.get('seconds_through_layers', float('nan')) * 1e3:.1f}")
        table.add_row(weights, f"{records[0]['weight_bytes'] / 2**20:.0f}", *cells)
    console.print(table)
