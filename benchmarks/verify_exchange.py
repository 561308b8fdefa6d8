"""What one Verify exchange costs around the target's compute: a tiny target served in its own
process, one sequence decoding one token a step over an open VerifySession stream (the coordinator's
path every step), the client's wall time per exchange against the compute_seconds the target reports.

    .venv/bin/python benchmarks/verify_exchange.py [--steps 600]

Prints medians: the exchange's wall, the server's compute, and the difference (the wire and the
service's own path: the hop to its compute thread, the batcher, protobuf). benchmarks/grpc_rtt.py
gives grpc.aio's floor for the same exchange without any service behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_tools import tinymodels

PORT = 51077
WARM_UP = 100


async def _exchanges(steps: int) -> tuple[list[float], list[float]]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{PORT}")
    stub = pb_grpc.TargetServiceStub(channel)
    for _ in range(600):  # until it has loaded and warmed its model
        try:
            await stub.GetInfo(pb.TargetServiceGetInfoRequest(), wait_for_ready=True, timeout=120)
            break
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.2)
    call = stub.VerifySession()
    tokens, known, walls, computes = [1, 2, 3], 0, [], []
    for step in range(steps + WARM_UP):
        request = pb.VerifySessionRequest(verify=pb.VerifyRequest(sequence_id="x", known_len=known, append_tokens=tokens[known:]))
        start = time.perf_counter()
        await call.write(request)
        response = (await call.read()).verify
        if step >= WARM_UP:
            walls.append(time.perf_counter() - start)
            computes.append(response.compute_seconds)
        tokens.append(response.next_token % 250)
        known = response.cached_len
        if len(tokens) > 400:  # stay well inside the tiny model's context: a new sequence
            call.cancel()
            call, tokens, known = stub.VerifySession(), [1, 2, 3], 0
    call.cancel()
    await channel.close()
    return walls, computes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tinymodels.save(tinymodels.tiny_pair()[0], pathlib.Path(folder))
        target = subprocess.Popen([sys.executable, "-m", "specdec_tools.cli", "serve", "target", "--model", folder, "--device", "cpu",
                                   "--port", str(PORT), "--metrics-port", "-1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            walls, computes = asyncio.run(_exchanges(args.steps))
        finally:
            target.terminate()
            target.wait()
    outside = [w - c for w, c in zip(walls, computes)]
    print(f"exchange {statistics.median(walls) * 1e6:.0f} us, target compute {statistics.median(computes) * 1e6:.0f} us, "
          f"outside the compute {statistics.median(outside) * 1e6:.0f} us (medians of {len(walls)} steps)")


if __name__ == "__main__":
    main()
