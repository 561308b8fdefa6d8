"""What a prompt's chunk adds to a forward of decoding rows, by the chunk's tokens and the keys
already cached before it, through TargetEngine.verify_batch in one process (the compact stack, where
the chunk rides in the rows' forward).

    .venv/bin/python benchmarks/chunk_cost.py [--weights gguf-a8] [--rows 8] [--keys 200,1000,2000,3500]
        [--tokens 2,4,8,16,32,64] [--repeats 6]

Prints, for every keys x tokens, the median time the chunk added to the rows' pass (a pass with the
chunk less the rows' pass without it, alternated) and that per chunk token. The cost has a part
that does not grow with the chunk's tokens (the prompt's cached keys and values are read once a
forward) and a part per token that grows with the keys (its attention): what the target's chunk
sizing (target_service/engine.py, _chunk_budget) weighs.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="gguf-a8")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--keys", default="200,1000,2000,3500", help="Prompt tokens cached before the chunk, comma-separated.")
    parser.add_argument("--tokens", default="2,4,8,16,32,64", help="Chunk tokens, comma-separated.")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()

    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.loading import DEFAULT_TARGET
    from specdec_tools.workload import load_prompt_ids
    from target_service.engine import TargetEngine

    served = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights=args.weights))  # as the target service serves it
    loaded, engine = served.loaded, TargetEngine(served.lm)
    keys, sizes = [int(k) for k in args.keys.split(",")], [int(n) for n in args.tokens.split(",")]
    prompts = (load_prompt_ids(loaded.tokenizer, "chat", args.rows) * args.rows)[:args.rows]
    long_prompt = (sum(load_prompt_ids(loaded.tokenizer, "grounded", 8), []) * 20)[:max(keys) + max(sizes) + 1]

    for P in keys:
        base, added = _measure(engine, P, sizes, prompts, long_prompt, args.repeats)
        print(f"{P:5d} keys: {args.rows} rows' pass {base * 1e3:.2f} ms; a chunk adds " + ", ".join(
            f"{n} tokens {(t - base) * 1e3:.1f} ms ({(t - base) / n * 1e3:.2f}/token)" for n, t in added.items()), flush=True)


def _measure(engine, P: int, sizes: list[int], prompts: list[list[int]], long_prompt: list[int], repeats: int):
    """(the rows' pass alone, {chunk tokens: the pass with that chunk}), medians, with P keys cached
    before the chunk; passes with and without a chunk alternate."""
    from specdec.serving.batcher import Requeue
    from specdec.calls.request import VerifyCall
    from specdec.maths.sampling import SamplingConfig

    greedy = SamplingConfig()
    # rows that decode (fresh for every key count, so their own caches stay short)
    ids = [f"row{P}-{i}" for i in range(len(prompts))]
    results = engine.verify_batch([VerifyCall(s, 0, p, [], [], greedy) for s, p in zip(ids, prompts)])
    state = [(r.cached_len, r.next_token) for r in results]
    long_id = f"long{P}"
    call = VerifyCall(long_id, 0, long_prompt[:P], [], [], greedy)
    while isinstance(result := engine.verify_batch([call], decode_ahead=False)[0], Requeue):
        call = result.call

    def step(chunk: int) -> float:
        """One pass of the rows' steps, with a `chunk`-token chunk of the long prompt (0: none)."""
        nonlocal state
        calls = [VerifyCall(s, known, [last], [], [], greedy) for s, (known, last) in zip(ids, state)]
        if chunk:
            # the chunk's size fixed: no limit but this one, whatever the costs measured so far
            engine.max_prefill_tokens, engine._forward_s, engine._chunk_token_s = chunk, 1.0, 1e-9
            calls.append(VerifyCall(long_id, P, long_prompt[P:P + chunk + 1], [], [], greedy))
        start = time.perf_counter()
        out = engine.verify_batch(calls, decode_ahead=False)
        elapsed = time.perf_counter() - start
        if chunk:
            assert isinstance(out[-1], Requeue) and engine.store._sequences[long_id].cached == P + chunk
        state = [(r.cached_len, r.next_token) for r in out[:len(ids)]]
        return elapsed

    alone, added = [], {}
    for n in sizes:
        times = []
        for _ in range(repeats):
            alone.append(step(0))
            times.append(step(n))
        added[n] = statistics.median(times)
    for s in [*ids, long_id]:
        engine.release(s)
    return statistics.median(alone), added

if __name__ == "__main__":
    main()
