"""What a long prompt costs the target's other sequences, in the target engine alone (no gRPC).

    .venv/bin/python benchmarks/long_prompt.py --mix            # a step of 10 short rows, with a long row beside
    .venv/bin/python benchmarks/long_prompt.py --mix --no-split # the same, every row in one padded pass
    .venv/bin/python benchmarks/long_prompt.py --chunks         # a 4,096-token prompt fed in chunks of n

`--mix`: ten sequences with 60-token prompts and one with a LONG-token prompt (default 4,000) decode
one token a step through TargetEngine.verify_batch; prints the median step of the ten alone, of the
ten with the long one, and of the long one alone. `--no-split` turns batching.pad_groups off (one
pass pads every row to the longest cache, as before it existed). `--chunks`: the time of each
chunk of n tokens (n = 8, 32, 128, 256) feeding a 4,096-token prompt, at a few context lengths, and
the whole prompt's.
"""

from __future__ import annotations

import argparse
import time


def _engine(weights: str, max_prefill_tokens: int = 0):
    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.loading import DEFAULT_TARGET
    from target_service.engine import TargetEngine

    served = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights=weights))  # as the target service serves it
    return TargetEngine(served.lm, max_prefill_tokens=max_prefill_tokens)


def mix(weights: str, long: int, split: bool) -> None:
    from specdec.forward import batching
    from specdec.calls.request import VerifyCall
    from specdec.maths.sampling import SamplingConfig

    if not split:
        batching.pad_groups = lambda cached: [list(range(len(cached)))]
    engine, state = _engine(weights), {}

    def step(ids: list[str]) -> float:
        calls = [VerifyCall(sid, state[sid][1], state[sid][0][state[sid][1]:], [], [], SamplingConfig()) for sid in ids]
        start = time.perf_counter()
        results = engine.verify_batch(calls, decode_ahead=False)
        elapsed = time.perf_counter() - start
        for sid, result in zip(ids, results):
            state[sid] = (state[sid][0] + [result.next_token], result.cached_len)
        return elapsed

    for i in range(10):
        state[f"s{i}"] = ([1 + (i * 7 + j) % 500 for j in range(60)], 0)
    state["long"] = ([1 + (j * 13) % 5000 for j in range(long)], 0)
    short = [f"s{i}" for i in range(10)]
    step(short), step(["long"]), step(short + ["long"])
    median = lambda ids: 1000 * sorted(step(ids) for _ in range(5))[2]  # noqa: E731
    print(f"step of 10 short rows: {median(short):.1f} ms; with a {long}-token row beside: {median(short + ['long']):.1f} ms; "
          f"the long row alone: {median(['long']):.1f} ms ({'split by pad_groups' if split else 'one padded pass'})")


def chunks(weights: str) -> None:
    from specdec.kv.store import SequenceStore
    from specdec.model.lm import feed

    engine = _engine(weights)
    prompt = [1 + (j * 13) % 5000 for j in range(4096)]
    for n in (8, 32, 128, 256):
        seq, times = SequenceStore(8, 600).sync("x", 0, prompt), []
        while seq.cached + n <= len(prompt):
            at, start = seq.cached, time.perf_counter()
            feed(engine.lm, seq, n)
            times.append((at, time.perf_counter() - start))
        total = sum(t for _, t in times)
        marks = ", ".join(f"at {at}: {1000 * t:.0f} ms" for at, t in times if at in (0, 1024 - 1024 % n, 2048, 4096 - 2 * n))
        print(f"chunks of {n}: the prompt in {total:.1f} s ({1000 * total / len(prompt):.2f} ms a token); {marks}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="gguf-a8")
    parser.add_argument("--mix", action="store_true")
    parser.add_argument("--no-split", action="store_true", help="with --mix: one padded pass, no pad_groups")
    parser.add_argument("--long", type=int, default=4000)
    parser.add_argument("--chunks", action="store_true")
    args = parser.parse_args()
    if args.chunks:
        chunks(args.weights)
    else:
        mix(args.weights, args.long, not args.no_split)


if __name__ == "__main__":
    main()
