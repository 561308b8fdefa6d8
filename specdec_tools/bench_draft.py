"""Draft-side batching, measured: N concurrent Propose streams, batched vs one forward per stream.

    .venv/bin/python -m specdec_tools.bench_draft [--model smollm2-135m-instruct] [--streams 1,4,8]

One real draft service (gRPC on loopback, the model given), driven by N concurrent streams, each a
sequence of its own (a chat prompt) asking for `--tokens` greedy draft tokens per Propose, then the
next Propose after a rollback of half of them, as the coordinator would. Every round runs batched
(the service's batcher on) and alone (its max batch size set to 1) back to back, so machine noise
hits both alike; the medians of drafted tokens per second and their ratio are printed. The tokens
proposed must be the same both ways (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time


async def _one_stream(stub, pb, seq_id: str, prompt: list[int], tokens: int, steps: int) -> list[int]:
    from specdec.serving.wire import propose_call_to_proto
    from specdec.calls.request import ProposeCall

    out: list[int] = []
    known, append = 0, list(prompt)
    for _ in range(steps):
        request = propose_call_to_proto(ProposeCall(seq_id, known, append, tokens))
        drafted = [m.token_id async for m in stub.Propose(request, timeout=600)]
        out += drafted
        keep = drafted[: len(drafted) // 2]  # half accepted, then the target's own token (here: 0)
        known, append = known + len(append), keep + [0]
    await stub.Release(pb.DraftServiceReleaseRequest(sequence_id=seq_id), timeout=30)
    return out


async def _round(address: str, prompts: list[list[int]], streams: int, tokens: int, steps: int, tag: str):
    import grpc

    from protos import specdec_pb2 as pb
    from protos import specdec_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.DraftServiceStub(channel)
        start = time.perf_counter()
        outs = await asyncio.gather(*(_one_stream(stub, pb, f"{tag}-{i}", prompts[i % len(prompts)], tokens, steps)
                                      for i in range(streams)))
        seconds = time.perf_counter() - start
    return sum(len(o) for o in outs) / seconds, outs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_tools.bench_draft", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="Draft model: alias, hub id, folder or .gguf.")
    parser.add_argument("--streams", default="1,4,8", help="Concurrent streams, comma-separated.")
    parser.add_argument("--tokens", type=int, default=8, help="Draft tokens per Propose.")
    parser.add_argument("--steps", type=int, default=4, help="Propose calls per stream (each after a rollback).")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.streams.split(",")]
    return asyncio.run(_run(args, levels))


async def _run(args, levels: list[int]) -> int:
    import torch

    from draft_service.config import DraftConfig
    from draft_service.servicer import serve
    from specdec_tools.workload import load_prompt_ids
    from specdec.model.loading import load_tokenizer

    prompts = load_prompt_ids(load_tokenizer(args.model), "chat", 16)
    ready = asyncio.get_running_loop().create_future()
    config = dataclasses.replace(DraftConfig(port=0, metrics_port=-1, device="cpu"), drafter="model", model=args.model)
    task = asyncio.create_task(serve(config, ready=ready, signals=False))
    server = await ready
    address, batcher = f"127.0.0.1:{server.port}", server.servicer.batcher
    print(f"draft {args.model} on {torch.get_num_threads()} threads; {args.tokens} tokens per Propose, {args.steps} Proposes per stream")
    print(f"{'streams':>7}  {'batched tok/s':>13}  {'alone tok/s':>11}  {'ratio':>6}  rows/pass  identical")
    try:
        await _round(address, prompts, 2, args.tokens, 1, "warmup")
        for streams in levels:
            rates: dict[str, list[float]] = {"batched": [], "alone": []}
            outputs: dict[str, list] = {}
            rows0, passes0 = batcher.rows, batcher.batches
            for r in range(args.repeats):
                for mode in ("batched", "alone") if r % 2 == 0 else ("alone", "batched"):
                    batcher.max_batch_size = 16 if mode == "batched" else 1
                    rate, outs = await _round(address, prompts, streams, args.tokens, args.steps, f"{mode}-{streams}-{r}")
                    rates[mode].append(rate)
                    outputs[mode] = outs
            batched, alone = statistics.median(rates["batched"]), statistics.median(rates["alone"])
            per_pass = (batcher.rows - rows0) / max(1, batcher.batches - passes0)
            same = outputs["batched"] == outputs["alone"]
            print(f"{streams:>7}  {batched:>13.1f}  {alone:>11.1f}  {batched / alone:>5.2f}x  {per_pass:>9.1f}  {'yes' if same else 'NO'}")
    finally:
        await server.stop(0)
        task.cancel()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
