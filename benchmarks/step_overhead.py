"""Wire + coordination per step through the gRPC stack on loopback: a tiny target service and a
coordinator (`specdec serve`, each its own process), one greedy request at a time over the
coordinator's Generate, as `specdec bench`'s gRPC rows run.

    .venv/bin/python benchmarks/step_overhead.py [--requests 12] [--max-new-tokens 96]

Per request, from the Stats the coordinator returns (the coordinator's own clock):
- wire = the exchanges' wall time less the compute the services report (gRPC, both event loops,
  the target's hop to its compute thread, its batcher and protobuf);
- coordination = the loop's time less draft, verify and wire: the coordinator's Python between
  the calls (policy, cost model, building the calls);
both divided by the request's target passes. Coordinators share the target: with an n-gram draft
service (the target drafts by lookup), with `--draft ngram` (prompt lookup in the coordinator) and
with speculation off, each twice: as runs in the target (`--decode-runs`, the default: one Decode
stream, no exchange between passes; wire + coordination is then the request's wall time less the
target's compute) and as Verify exchanges (`--no-decode-runs` with --decode-ahead 0, so every pass
is one exchange). The tiny model's text rarely repeats, so most steps verify no draft: the figures
are the path's cost, not speculation's. Prints medians over the requests, and a digest of the tokens
generated, which must not change between two versions that claim the same greedy output.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import statistics
import tempfile

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_tools import tinymodels
from specdec_tools.stacks import Stack

# Prompts the tiny model continues with repeats: prompt lookup finds drafts in them.
PROMPTS = ["the cat sat on the mat and the cat sat on the ", "one two three one two three one two ",
           "abc abc abc abc abc ", "to be or not to be, to be or not "]


def _run(address: str, requests: int, max_new: int) -> tuple[list[float], list[float], list[float], str]:
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.CoordinatorServiceStub(channel)
    wires, coords, tokens_per_step, digest = [], [], [], hashlib.sha256()
    for i in range(requests + 2):  # the first two warm the path up
        prompt = list(PROMPTS[i % len(PROMPTS)].encode())
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new,
                                     speculation=pb.SpeculationParams(draft_length=8, adaptive=True))
        response = stub.Generate(request, timeout=120)
        s = response.stats
        if i < 2:
            continue
        digest.update(bytes(str(list(response.token_ids)), "ascii"))
        steps = max(1, s.steps)
        wires.append(s.wire_seconds / steps)
        coords.append(max(0.0, s.total_seconds - s.draft_seconds - s.verify_seconds - s.wire_seconds) / steps)
        tokens_per_step.append(s.completion_tokens / steps)
    channel.close()
    return wires, coords, tokens_per_step, digest.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = tinymodels.save(tinymodels.tiny_pair()[0], pathlib.Path(folder) / "tiny")
        stack = Stack(model, pathlib.Path(folder) / "logs")
        try:
            stack.start_target()
            draft = stack.start_draft("ngram")
            coordinators = {}
            paths = (("run in the target", ("--decode-runs",)), ("exchange a pass", ("--no-decode-runs", "--decode-ahead", "0")))
            for path, flags in paths:
                coordinators[f"ngram draft service, {path}"] = stack.start_coordinator(draft, *flags)
                coordinators[f"ngram in coordinator, {path}"] = stack.start_coordinator("ngram", *flags)
                coordinators[f"speculation off, {path}"] = stack.start_coordinator("", *flags)
            stack.wait()
            for name, address in coordinators.items():
                wires, coords, per_step, digest = _run(address, args.requests, args.max_new_tokens)
                wire, coord = statistics.median(wires) * 1e6, statistics.median(coords) * 1e6
                print(f"{name}: wire {wire:.0f} us + coordination {coord:.0f} us = {wire + coord:.0f} us a step "
                      f"({statistics.median(per_step):.2f} tokens a step; medians of {len(wires)} requests; tokens {digest})")
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
