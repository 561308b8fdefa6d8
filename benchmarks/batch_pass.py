"""One batched target pass: R sequences (the chat prompts, prefilled) decoding one token each, as the
target serves R streams under load, through TargetEngine.verify_batch in one process.

    .venv/bin/python benchmarks/batch_pass.py [--weights gguf-a8] [--rows 8] [--steps 60] [--repeats 3]
    .venv/bin/python benchmarks/batch_pass.py --rows 1,4,8 --draft-tokens 0,1,3,7 --steps 30 --repeats 1

Prints the median and 10th percentile of a pass over steps x repeats, for every rows x draft
tokens (each row verifying that many draft tokens besides its own: what a drafted position costs
once several rows share the pass, which is what the load cap on draft length weighs). Run two
versions alternately (PYTHONPATH=<tree>) to compare them: the machine drifts by 10-20% within minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="gguf-a8")
    parser.add_argument("--rows", default="8", help="Rows a pass, comma-separated for several.")
    parser.add_argument("--draft-tokens", default="0", help="Draft tokens each row verifies, comma-separated for several.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.loading import DEFAULT_TARGET
    from specdec.calls.request import VerifyCall
    from specdec.maths.sampling import SamplingConfig
    from specdec_tools.workload import load_prompt_ids
    from target_service.engine import TargetEngine

    served = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights=args.weights))  # as the target service serves it
    loaded, engine = served.loaded, TargetEngine(served.lm)
    greedy = SamplingConfig()
    for rows in (int(r) for r in args.rows.split(",")):
        prompts = (load_prompt_ids(loaded.tokenizer, "chat", rows) * rows)[:rows]
        for draft in (int(d) for d in args.draft_tokens.split(",")):
            times = []
            for repeat in range(args.repeats):
                ids = [f"r{rows}-{draft}-{repeat}-{i}" for i in range(rows)]
                results = engine.verify_batch([VerifyCall(s, 0, p, [], [], greedy) for s, p in zip(ids, prompts)])
                known, last = [len(p) for p in prompts], [r.next_token for r in results]
                for _ in range(args.steps):
                    # a fixed token drafted: mostly rejected, so every pass verifies `draft` positions more per row
                    calls = [VerifyCall(s, known[i], [last[i]], [5] * draft, [], greedy) for i, s in enumerate(ids)]
                    start = time.perf_counter()
                    results = engine.verify_batch(calls, decode_ahead=False)
                    times.append(time.perf_counter() - start)
                    known, last = [r.cached_len for r in results], [r.next_token for r in results]
                for s in ids:
                    engine.release(s)
            print(f"{rows}-row pass, {draft} draft tokens a row ({args.weights}): median {statistics.median(times) * 1e3:.2f} ms, "
                  f"p10 {sorted(times)[len(times) // 10] * 1e3:.2f} ms over {len(times)} passes", flush=True)

if __name__ == "__main__":
    main()
