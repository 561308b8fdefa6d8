"""Where a CPU decode step's time goes: the embedded target decoding alone in one process.

    .venv/bin/python benchmarks/decode_profile.py --weights gguf-a8            # tok/s, 3 runs
    .venv/bin/py-spy record --rate 100 --format raw -o /tmp/decode.raw -- \
        .venv/bin/python benchmarks/decode_profile.py --weights gguf-a8
    .venv/bin/python benchmarks/decode_profile.py --summarise /tmp/decode.raw   # shares by place
    .venv/bin/python benchmarks/decode_profile.py --attention                   # the attention kernel alone

The decode runs through TargetEngine.verify with no draft, one token a step, as specdec-off serves
it. `--summarise` reads py-spy's raw output and prints each place's share of the samples under
`verify` (a ctypes call's line holds the C kernel's own time). `--attention` times the row-exact
attention kernel on R query rows over T keys in SmolLM2's shape (9 heads, 3 KV heads, D = 64).
"""

from __future__ import annotations

import argparse
import collections
import time


def decode(weights: str, tokens: int, runs: int) -> None:
    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.loading import DEFAULT_TARGET
    from specdec.calls.request import VerifyCall
    from specdec.maths.sampling import SamplingConfig
    from target_service.engine import TargetEngine

    served = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights=weights))  # as the target service serves it
    prompt = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
    ids = served.loaded.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    engine = TargetEngine(served.lm)
    for run in range(runs):
        out, known = list(ids), 0
        start = time.perf_counter()
        for _ in range(tokens):
            result = engine.verify(VerifyCall(f"run-{run}", known, out[known:], [], [], SamplingConfig()))
            out.append(result.next_token)
            known = result.cached_len
        print(f"{weights}: {tokens / (time.perf_counter() - start):.1f} tok/s", flush=True)


def summarise(raw: str, top: int) -> None:
    own, total = collections.Counter(), 0
    for line in open(raw):
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if any("verify" in f for f in frames):
            total += int(count)
            own[frames[-1]] += int(count)
    print(f"{total} samples under verify")
    for place, count in own.most_common(top):
        print(f"{100 * count / total:5.1f}%  {place}")


def attention(repeats: int) -> None:
    import torch

    from specdec.model.cpu import gemm_kernel

    kernel = gemm_kernel.load()
    heads, heads_kv, dim = 9, 3, 64
    # one row: a decode step; 8 rows: a verify or a short chunk; 256 rows: a prompt's chunk
    for rows, keys in ((1, 64), (1, 256), (1, 1024), (1, 4000), (8, 4000), (256, 2048), (256, 4096)):
        q, k, v = torch.randn(1, heads, rows, dim), torch.randn(1, heads_kv, keys, dim), torch.randn(1, heads_kv, keys, dim)
        out = torch.empty(1, rows, heads, dim)
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        args = (q.data_ptr(), qs[0], qs[1], qs[2], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2],
                None, 0, 0, 0, 1, heads, heads_kv, rows, keys, dim, dim ** -0.5, out.data_ptr())
        calls = max(3, repeats // (rows * keys // 64))
        pairs = heads * rows * (keys - (rows - 1) / 2)  # causal: row i sees keys - rows + 1 + i
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for _ in range(max(1, calls // 10)):
                kernel.attention(*args)
            start = time.perf_counter()
            for _ in range(calls):
                kernel.attention(*args)
            call_s = (time.perf_counter() - start) / calls
            print(f"{rows} row(s) x {keys} keys, {threads} thread(s): {1e6 * call_s:.1f} us a call, "
                  f"{1e9 * call_s / pairs:.2f} ns a query-key pair")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="gguf-a8")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--summarise", metavar="RAW", help="py-spy raw output to summarise instead of decoding")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--attention", action="store_true", help="time the attention kernel instead of decoding")
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise, args.top)
    elif args.attention:
        attention(2000)
    else:
        decode(args.weights, args.tokens, args.runs)


if __name__ == "__main__":
    main()
