"""Target forward time with transformers' DynamicCache against specdec's in-place cache (specdec/kv/buffers.py).

Usage: .venv/bin/python benchmarks/kv_append.py [--model smollm2-135m-instruct] [--contexts 300,1500,4000]

For each context length and each number of new positions n (a verify of n - 1 draft tokens), it
times the same forward with both caches, interleaved, and prints the medians, their ratio, and
whether the logits are bit-identical.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.kv.store import Sequence  # noqa: E402
from specdec.model.assembly import LMOptions, load_lm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--contexts", default="300,1500,4000")
    parser.add_argument("--positions", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    # the kernel off (packed_gemm_rows=0), as this has always measured: transformers' forward over the
    # stock kernels, so that the caches are the only difference between the two arms
    served = load_lm(LMOptions(model=args.model, device="cpu", packed_gemm_rows=0))
    loaded, lm = served.loaded, served.lm
    positions = [int(x) for x in args.positions.split(",")]
    print(f"{'context':>8} {'n':>3} {'DynamicCache ms':>16} {'in-place ms':>12} {'ratio':>6}  identical")
    for ctx in (int(x) for x in args.contexts.split(",")):
        seqs = {}
        for kind in ("dynamic", "inplace"):
            seq = Sequence(kind, tokens=[100 + i % 40000 for i in range(ctx)] + [9])
            seq.cache = DynamicCache(config=loaded.model.config) if kind == "dynamic" else lm.new_cache()
            lm.forward(seq)
            seq.tokens.pop()
            seq.crop_cache(ctx)
            seqs[kind] = seq
        for n in positions:
            times: dict[str, list[float]] = {"dynamic": [], "inplace": []}
            logits = {}
            for rep in range(args.repeats):
                for kind in (("dynamic", "inplace") if rep % 2 == 0 else ("inplace", "dynamic")):
                    seq = seqs[kind]
                    seq.tokens.append(7)
                    start = time.perf_counter()
                    logits[kind] = lm.forward(seq, list(range(5, 5 + n - 1)), keep=n)
                    times[kind].append(time.perf_counter() - start)
                    seq.tokens.pop()
                    seq.crop_cache(ctx)
            a, b = (statistics.median(times[k]) * 1000 for k in ("dynamic", "inplace"))
            same = torch.equal(logits["dynamic"], logits["inplace"])
            print(f"{ctx:>8} {n:>3} {a:>16.1f} {b:>12.1f} {a / b:>5.2f}x  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
