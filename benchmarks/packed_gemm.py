"""Target forward time V(n) with the stock fp32 GEMM against specdec's small-M kernel (specdec/model/cpu/gemm.py).

Usage: .venv/bin/python benchmarks/packed_gemm.py [--model smollm2-135m-instruct] [--rows 4096] [--min-rows 1]

Packs the model's linear layers once into the kernel's panels, then measures the verification cost curve (one forward over
n new positions after a 300-token context, n logits kept) with packing switched off and on,
interleaved round by round so drift on a shared machine hits both alike, and prints the medians and
their ratio. It then compares the logits of both paths over a verify-sized forward: the largest
difference and whether every position's argmax (the greedy token) agrees.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.model.cpu import gemm  # noqa: E402
from specdec_tools.bench import measure_cost_curve  # noqa: E402
from specdec.kv.store import Sequence  # noqa: E402
from specdec.model.assembly import LMOptions, load_lm  # noqa: E402


def mode(arm: str):
    return gemm.disabled() if arm == "stock" else contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=gemm.DEFAULT_ROWS)
    parser.add_argument("--min-rows", type=int, default=gemm.DEFAULT_MIN_ROWS)
    parser.add_argument("--positions", default="1,2,3,4,5,6,8,9,12,16,17,24,40,64")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    # fp32 weights: the stock arm (gemm.disabled) computes the same weights, so the kernel is the only difference
    served = load_lm(LMOptions(model=args.model, device="cpu", dtype="float32", weights="fp32", packed_gemm_rows=args.rows,
                               packed_gemm_min_rows=args.min_rows))
    report, lm = served.packed, served.lm
    if report is None:
        parser.error("nothing packed: the kernel needs --rows > 0 and a C compiler to build it (see the log)")
    grown = "unknown" if report.resident_bytes is None else f"+{report.resident_bytes / 2**20:.0f} MiB"
    print(f"packed {report.layers} linear layers for the small-M kernel at {args.min_rows}-{args.rows} rows (resident memory {grown})")
    context = [100 + (i * 37) % 40000 for i in range(300)]
    ns = [int(x) for x in args.positions.split(",")]
    curves: dict[str, list] = {"stock": [], "packed": []}
    for rnd in range(args.rounds):
        for arm in (("stock", "packed") if rnd % 2 == 0 else ("packed", "stock")):
            with mode(arm):
                curves[arm].append(measure_cost_curve(lm, context, ns, repeats=2))
    print(f"{'n':>3} {'stock ms':>9} {'packed ms':>10} {'ratio':>6}")
    for n in ns:
        a, b = (statistics.median(c(n) for c in curves[arm]) * 1000 for arm in ("stock", "packed"))
        print(f"{n:>3} {a:>9.1f} {b:>10.1f} {a / b:>5.2f}x")
    logits = {}
    width = min(args.rows, 16)  # a verify-sized forward
    for arm in ("stock", "packed"):
        seq = Sequence(arm, tokens=list(context))
        lm.forward(seq)
        seq.crop_cache(len(context) - 1)
        with mode(arm):
            logits[arm] = lm.forward(seq, context[:width - 1], keep=width)
    diff = (logits["stock"] - logits["packed"]).abs().max().item()
    same = bool(torch.equal(logits["stock"].argmax(-1), logits["packed"].argmax(-1)))
    print(f"logits over {width} positions: max |difference| {diff:.2e}, greedy tokens agree: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
