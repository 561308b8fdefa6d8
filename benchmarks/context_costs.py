"""What a prompt token and a decoded token cost the target in one process, by chunk size and by
context length: the two costs chunked prefill and long prompts trade against each other.

    .venv/bin/python benchmarks/context_costs.py [--weights gguf-a8] [--chunks 8,32,128] [--contexts 1024,4096]

Prefill: a 512-token prompt (seeded random ids) fed in chunks of each size, ms per token. Decode:
the median of 20 single-token forwards after a prompt of each length, ms per token. Run two
versions alternately (PYTHONPATH=<tree>) to compare them: the machine drifts by 10-20% within minutes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="gguf-a8")
    parser.add_argument("--chunks", default="8,32,128")
    parser.add_argument("--contexts", default="1024,4096")
    args = parser.parse_args()

    from specdec.kv.store import Sequence
    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.lm import feed
    from specdec.model.loading import DEFAULT_TARGET

    lm = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights=args.weights)).lm  # as the target service serves it
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    rng = random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(max([512, *contexts]) + 32)]
    for chunk in (int(c) for c in args.chunks.split(",") if c.strip()):
        seq, fed, start = Sequence("prefill", ids[:512]), 0, time.perf_counter()
        while seq.cached + chunk <= 512:
            feed(lm, seq, chunk)
            fed += chunk
        print(f"prefill in chunks of {chunk}: {(time.perf_counter() - start) / fed * 1e3:.3f} ms a token", flush=True)
    for context in contexts:
        seq = Sequence("decode", ids[:context])
        while seq.cached < context - 1:
            feed(lm, seq, min(512, context - 1 - seq.cached))
        times = []
        for i in range(20):
            start = time.perf_counter()
            lm.forward(seq, [], keep=1)
            times.append(time.perf_counter() - start)
            seq.tokens.append(ids[context + i])
        print(f"decode after {context} tokens: {statistics.median(times) * 1e3:.2f} ms a token", flush=True)


if __name__ == "__main__":
    main()
