"""The target's own prompt lookup on the passes it decodes ahead (coordinator --lookup-ahead), side by
side with the exchange per step it replaces, through the gRPC services on loopback with a real model.

    .venv/bin/python benchmarks/lookup_ahead.py [--weights gguf-a8] [--prompts chat,grounded]
        [--limit 4] [--max-new-tokens 128] [--repeats 2] [--decode-ahead 8,16] [--stream]

One target service (the embedded SmolLM2-135M-Instruct unless --target), one n-gram draft service,
and three coordinators on them: the n-gram draft with --lookup-ahead (the default), the same with
--no-lookup-ahead (the coordinator asks the draft service and the target once a step that drafts),
and speculation off (draft_length 0, decoding ahead plainly). Several --decode-ahead values give a
lookup-ahead coordinator each (more passes an exchange: fewer exchanges, longer bursts of tokens).
Requests are unary Generate calls, answered whole (after the first token the target decodes the
rest in one exchange); --stream adds each lookup-ahead coordinator's requests as GenerateStream,
whose exchanges carry --decode-ahead + 1 passes. Requests are greedy, one at a time, interleaved
over the rows and over --repeats, so the machine's drift falls on all alike.

Prints per prompt set and row: tokens per second (client wall), the speed-up over speculation off,
target passes per token, wire + coordination per target pass in microseconds (from the
coordinator's Stats: the exchanges' wall less the services' compute, and the loop's time less
draft, verify and wire, divided by the passes), and whether every request's tokens equal
speculation off's.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import tempfile
import time

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_tools.stacks import Stack
from specdec_tools.workload import load_prompt_ids

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="", help="target model (default: the services' default)")
    parser.add_argument("--weights", default="gguf-a8")
    parser.add_argument("--prompts", default="chat,grounded")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-ahead", default="", help="comma-separated --decode-ahead values for lookup-ahead rows "
                        "(default: the coordinator's own)")
    parser.add_argument("--stream", action="store_true", help="also each lookup-ahead coordinator's requests as GenerateStream "
                        "(bursts of --decode-ahead + 1 passes) beside its unary Generate (answered whole)")
    args = parser.parse_args()

    from specdec.model.loading import DEFAULT_TARGET, load_tokenizer

    tokenizer = load_tokenizer(args.target or DEFAULT_TARGET)
    sets = {name: load_prompt_ids(tokenizer, name, args.limit) for name in args.prompts.split(",")}
    with tempfile.TemporaryDirectory() as folder:
        stack = Stack(args.target, pathlib.Path(folder) / "logs")
        try:
            stack.start_target("--weights", args.weights)
            draft = stack.start_draft("ngram")
            ahead = [int(n) for n in args.decode_ahead.split(",") if n.strip()]
            addresses = {f"lookup ahead {n}": stack.start_coordinator(draft, "--decode-ahead", str(n)) for n in ahead} or \
                {"lookup ahead": stack.start_coordinator(draft)}
            streamed = {f"{row}, streamed": address for row, address in addresses.items()} if args.stream else {}
            addresses |= {"no lookup ahead": stack.start_coordinator(draft, "--no-lookup-ahead"),
                          "speculation off": stack.start_coordinator(draft)}
            addresses |= streamed
            rows = tuple(addresses)
            stack.wait()
            stubs = {row: pb_grpc.CoordinatorServiceStub(grpc.insecure_channel(a)) for row, a in addresses.items()}
            for stub in stubs.values():  # first requests pay for lazy initialisation
                stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=sets[next(iter(sets))][0]), max_new_tokens=8), timeout=300)
            totals = collections.defaultdict(lambda: collections.Counter())
            outputs: dict[tuple, list[int]] = {}
            for repeat in range(args.repeats):
                for name, prompts in sets.items():
                    for index, prompt in enumerate(prompts):
                        for row in rows:
                            length = 0 if row == "speculation off" else 8
                            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=args.max_new_tokens,
                                                         speculation=pb.SpeculationParams(draft_length=length, adaptive=True))
                            start = time.perf_counter()
                            if row in streamed:
                                tokens, s = _stream(stubs[row], request)
                            else:
                                response = stubs[row].Generate(request, timeout=600)
                                tokens, s = list(response.token_ids), response.stats
                            wall = time.perf_counter() - start
                            t = totals[(name, row)]
                            t["wall"] += wall
                            t["tokens"] += len(tokens)
                            t["passes"] += s.steps
                            t["wire"] += s.wire_seconds
                            t["coordination"] += max(0.0, s.total_seconds - s.draft_seconds - s.verify_seconds - s.wire_seconds)
                            outputs[(name, index, repeat, row)] = tokens
            for name, prompts in sets.items():
                off = totals[(name, "speculation off")]
                for row in rows:
                    t = totals[(name, row)]
                    same = sum(outputs[(name, i, r, row)] == outputs[(name, i, r, "speculation off")]
                               for i in range(len(prompts)) for r in range(args.repeats))
                    rate, base = t["tokens"] / t["wall"], off["tokens"] / off["wall"]
                    print(f"{name:9s} {row:18s} {rate:6.1f} tok/s  {rate / base:4.2f}x off  "
                          f"{t['passes'] / t['tokens']:.2f} passes/token  wire {t['wire'] / t['passes'] * 1e6:4.0f} + "
                          f"coordination {t['coordination'] / t['passes'] * 1e6:3.0f} us a pass  "
                          f"identical {same}/{len(prompts) * args.repeats}")
        finally:
            stack.stop()


def _stream(stub, request: pb.GenerateRequest):
    """The request as GenerateStream: (its tokens, the last message's statistics)."""
    streamed = pb.GenerateStreamRequest(token_ids=request.token_ids, max_new_tokens=request.max_new_tokens,
                                        speculation=request.speculation)
    tokens, stats = [], None
    for message in stub.GenerateStream(streamed, timeout=600):
        tokens.extend(message.token_ids)
        if message.HasField("stats"):
            stats = message.stats
    return tokens, stats


if __name__ == "__main__":
    main()
