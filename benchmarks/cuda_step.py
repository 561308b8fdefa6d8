"""Where a GPU decode step's time goes, and what the exact fixed-shape passes cost.

    python benchmarks/cuda_step.py --device cuda [--models smollm2-135m,llama-1b] [--out DIR]

Models of real shapes with seeded random weights (specdec_tools.tinymodels.real_shape), bf16. For
each: tokens per second decoding alone (one stream, 128 tokens) with transformers' generate(),
with the target engine on transformers' forward (--numerics fast) and with the fixed-shape passes
(--numerics exact, CUDA graphs); the cost of one verification pass over n = 1..16 positions and of
8 sequences batched; whether speculation with drafts copied from the reference equals decoding
alone; transformers' generate() with its static cache; and torch profiler tables of fast-mode
decode steps and of the exact pass run without its CUDA graph (the kernels the graph replays).
Runs on the CPU too (--device cpu, small counts), which is how its code path is tested.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from specdec.kv.store import Sequence  # noqa: E402
from specdec.model.lm import CausalLM  # noqa: E402
from specdec.model.gpu.static import StaticLM  # noqa: E402
from specdec.maths.sampling import SamplingConfig  # noqa: E402
from specdec_tools.tinymodels import real_shape  # noqa: E402
from specdec.calls.request import VerifyCall  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_decode(engine: TargetEngine, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Decoding alone through the engine (one Verify without drafts a token); tokens and seconds."""
    tokens, known = list(prompt), 0
    start = time.perf_counter()
    while len(tokens) - len(prompt) < n:
        result = engine.verify(VerifyCall("d", known, tokens[known:], [], [], SamplingConfig()))
        tokens.append(result.next_token)
        known = result.cached_len
    seconds = time.perf_counter() - start
    engine.store.release("d", retire=False)
    return tokens[len(prompt):], seconds


def engine_speculate(engine: TargetEngine, prompt: list[int], reference: list[int], gamma: int) -> tuple[list[int], float]:
    """Speculation with drafts copied from the reference and one token in four wrong: its tokens
    must be the reference's exactly."""
    tokens, known, step = list(prompt), 0, 0
    start = time.perf_counter()
    while len(tokens) - len(prompt) < len(reference):
        at = len(tokens) - len(prompt)
        draft = list(reference[at:at + gamma])
        step += 1
        if draft and step % 4 == 0:
            draft[-1] = (draft[-1] + 1) % engine.lm.vocab_size
        result = engine.verify(VerifyCall("s", known, tokens[known:], draft, [], SamplingConfig()))
        tokens += draft[:result.accepted] + [result.next_token]
        known = result.cached_len
    seconds = time.perf_counter() - start
    engine.store.release("s", retire=False)
    return tokens[len(prompt):len(prompt) + len(reference)], seconds


def pass_ms(lm, n: int, context: list[int], repeats: int, device: torch.device) -> float:
    """One forward over n new positions after `context`, median ms (the cache rolled back each time)."""
    seq = Sequence("p", tokens=list(context))
    lm.forward(seq, [], keep=1)
    times = []
    for _ in range(repeats):
        seq.tokens = list(context) + [5]  # one pending token and n - 1 draft tokens
        sync(device)
        start = time.perf_counter()
        lm.forward(seq, list(range(6, 6 + n - 1)), keep=n)
        sync(device)
        times.append(time.perf_counter() - start)
        seq.crop_cache(len(context))
    return 1000 * statistics.median(times)


def batch_ms(engine: TargetEngine, contexts: list[list[int]], gamma: int, repeats: int, device: torch.device) -> float:
    """8 sequences' verification of gamma draft tokens each in one batched call, median ms."""
    names = [f"b{i}" for i in range(len(contexts))]
    first = engine.verify_batch([VerifyCall(n, 0, c, [], [], SamplingConfig()) for n, c in zip(names, contexts)])
    times = []
    for _ in range(repeats):
        calls = [VerifyCall(n, len(c), [r.next_token], list(range(7, 7 + gamma)), [], SamplingConfig())
                 for n, c, r in zip(names, contexts, first)]
        sync(device)
        start = time.perf_counter()
        engine.verify_batch(calls)
        sync(device)
        times.append(time.perf_counter() - start)
    for n in names:
        engine.store.release(n, retire=False)
    return 1000 * statistics.median(times)


def profile_step(lm, context: list[int], device: torch.device) -> tuple[str, float]:
    """A profiler table of 3 decode steps, and the kernels launched a step (0 on the CPU)."""
    seq = Sequence("prof", tokens=list(context))
    lm.forward(seq, [], keep=1)
    seq.tokens.append(5)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            lm.forward(seq, [], keep=1)
            seq.tokens.append(5)
        sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return events.table(sort_by=sort, row_limit=20), kernels / 3


def run_model(name: str, device: torch.device, tokens: int, repeats: int, pass_rows: int) -> tuple[dict, str]:
    model = real_shape(name, seed=0).to(device=device, dtype=torch.bfloat16)
    prompt = list(range(100, 164))
    row: dict = {"model": name, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
        sync(device)
    row["hf_generate_tok_s"] = tokens / (time.perf_counter() - start)
    hf_tokens = out[0, len(prompt):].tolist()
    with torch.inference_mode():  # transformers' own static cache (no torch.compile: its compile alone outlasts the check)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, cache_implementation="static")
        model.generate(max_new_tokens=4, **kwargs)
        sync(device)
        start = time.perf_counter()
        model.generate(max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        sync(device)
    row["hf_generate_static_cache_tok_s"] = tokens / (time.perf_counter() - start)
    fast = TargetEngine(CausalLM(model, device))
    engine_decode(fast, prompt, 4)
    fast_tokens, seconds = engine_decode(fast, prompt, tokens)
    row["fast_tok_s"] = tokens / seconds
    exact_lm = StaticLM(model, device, pass_rows=pass_rows, slots=16, max_context=2048)
    exact = TargetEngine(exact_lm)
    engine_decode(exact, prompt, 4)
    exact_tokens, seconds = engine_decode(exact, prompt, tokens)
    row["exact_tok_s"] = tokens / seconds
    row["exact_cost_vs_fast_pct"] = 100 * (row["fast_tok_s"] / row["exact_tok_s"] - 1)
    row["agree_exact_vs_hf"] = sum(a == b for a, b in zip(exact_tokens, hf_tokens)) / tokens
    row["agree_fast_vs_hf"] = sum(a == b for a, b in zip(fast_tokens, hf_tokens)) / tokens
    for label, engine, reference in (("exact", exact, exact_tokens), ("fast", fast, fast_tokens)):
        spoken, seconds = engine_speculate(engine, prompt, reference, 4)
        row[f"{label}_speculation_identical"] = spoken == reference
        row[f"{label}_speculation_first_difference"] = next((i for i, (a, b) in enumerate(zip(spoken, reference)) if a != b), None)
    context = list(range(200, 456))
    for label, lm in (("exact", exact_lm), ("fast", CausalLM(model, device))):
        row[f"{label}_pass_ms"] = {n: round(pass_ms(lm, n, context, repeats, device), 3) for n in (1, 2, 4, 8, 16)}
    contexts = [list(range(300 + i, 300 + i + 128)) for i in range(8)]
    row["exact_batch8_g4_ms"] = round(batch_ms(exact, contexts, 4, repeats, device), 3)
    row["fast_batch8_g4_ms"] = round(batch_ms(fast, contexts, 4, repeats, device), 3)
    table, row["fast_kernels_per_step"] = profile_step(CausalLM(model, device), context, device)
    # the exact pass without its graph: the graph replays these kernels, so this is where its time goes
    eager = StaticLM(model, device, pass_rows=pass_rows, slots=16, max_context=2048, graphs=False)
    exact_table, row["exact_kernels_per_pass"] = profile_step(eager, context, device)
    row["exact_eager_pass_ms"] = {n: round(pass_ms(eager, n, context, repeats, device), 3) for n in (1, 4)}
    del exact_lm, exact, fast, eager, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, {"fast": table, "exact-eager": exact_table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="smollm2-135m,llama-1b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--pass-rows", type=int, default=64)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for name in args.models.split(","):
        row, tables = run_model(name, device, args.tokens, args.repeats, args.pass_rows)
        rows.append(row)
        print(json.dumps(row), flush=True)
        for mode, table in tables.items():
            print(f"profile of 3 {mode} decode steps ({name}):\n{table}", flush=True)
            if args.out:
                pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
                (pathlib.Path(args.out) / f"profile-{mode}-{name}.txt").write_text(table)
    if args.out:
        (pathlib.Path(args.out) / "cuda_step.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
