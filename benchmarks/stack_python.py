"""How much of a batched target pass is the Python around the one-call decoder stack: the pass
(TargetEngine.verify_batch), Stack.run (the caches' buffers opened, the C call, the caches advanced)
and the C call inside it, medians over 100 passes of R chat-prompt sequences decoding one token each.

    .venv/bin/python benchmarks/stack_python.py [--weights gguf-a8] [--rows 8]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="gguf-a8")
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()

    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.cpu.stack import installed
    from specdec.model.loading import DEFAULT_TARGET
    from specdec.calls.request import VerifyCall
    from specdec.maths.sampling import SamplingConfig
    from specdec_tools.workload import load_prompt_ids
    from target_service.engine import TargetEngine

    served = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights=args.weights))  # as the target service serves it
    loaded, engine = served.loaded, TargetEngine(served.lm)
    stack = installed(loaded.model.model)  # the one-call C stack, which packing installs for compact weights only
    if stack is None:
        parser.error(f"--weights {args.weights} runs no one-call stack: choose a compact format (gguf-a8, q4, int8, ...)")
    timings: dict[str, list[float]] = {"C call": [], "Stack.run": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[name].append(time.perf_counter() - start)
        return wrapper

    stack.kernel.stack = timed("C call", stack.kernel.stack)  # instance attributes: this process only
    stack.run = timed("Stack.run", stack.run)
    greedy = SamplingConfig()
    prompts = (load_prompt_ids(loaded.tokenizer, "chat", args.rows) * args.rows)[: args.rows]
    ids = [f"s{i}" for i in range(args.rows)]
    results = engine.verify_batch([VerifyCall(s, 0, p, [], [], greedy) for s, p in zip(ids, prompts)])
    known, last = [len(p) for p in prompts], [r.next_token for r in results]
    passes = []
    for values in timings.values():
        values.clear()
    for _ in range(100):
        start = time.perf_counter()
        results = engine.verify_batch([VerifyCall(s, known[i], [last[i]], [], [], greedy) for i, s in enumerate(ids)],
                                      decode_ahead=False)
        passes.append(time.perf_counter() - start)
        known, last = [r.cached_len for r in results], [r.next_token for r in results]
    median = statistics.median
    print(f"{args.rows}-row pass {median(passes) * 1e3:.2f} ms, Stack.run {median(timings['Stack.run']) * 1e3:.2f} ms, "
          f"its C call {median(timings['C call']) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
