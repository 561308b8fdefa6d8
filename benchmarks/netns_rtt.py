"""Tokens per second across a real network with a round-trip time: three hosts (network namespaces,
specdec_tools/netns.py), every link between the services through a delaying relay
(benchmarks/delay_relay.py; this kernel has no netem), at 0, 0.2, 0.5 and 2 ms of round trip.

    sudo .venv/bin/python benchmarks/netns_rtt.py [--requests 6] [--max-new-tokens 64] [--rtts-ms 0,0.2,0.5,2] [--draft-length 4]

Tiny target and noisy model draft (specdec_tools.tinymodels), each service in its own namespace
with one compute thread. Two coordinators over the same target and draft, measured alternately:
- drafted runs: the target asks its draft itself (--draft on the target), a step crosses the wire
  target -> draft -> target (one round trip), the coordinator only starts the run and reads tokens;
- steps (--no-decode-runs): the coordinator asks the draft, then the target, every step (two round
  trips through the coordinator).
Per path and RTT: tokens/s over the requests (one at a time), its ratio to RTT 0, the seconds per
target pass outside the target's compute (draft, wire and coordination), and whether the tokens are
those of RTT 0. The relay's measured round trip (TCP echo through a relay with the same delay) is
printed beside the one asked for: thread wake-ups add to it on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from delay_relay import DelayRelay  # noqa: E402

from protos import specdec_pb2 as pb  # noqa: E402
from protos import specdec_pb2_grpc as pb_grpc  # noqa: E402
from specdec_tools import tinymodels  # noqa: E402
from specdec_tools.children import free_port  # noqa: E402
from specdec_tools.netns import Network, namespaces_allowed  # noqa: E402

PROMPTS = ["the cat sat on the mat and the cat sat on the ", "one two three one two three one two ",
           "abc abc abc abc abc ", "to be or not to be, to be or not "]


def serve(net: Network, role: str, port: int, *flags: str) -> subprocess.Popen:
    command = ["ip", "netns", "exec", net.ns[role], sys.executable, "-m", "specdec_tools.cli", "serve", role,
               "--host", "0.0.0.0", "--port", str(port), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", f"SPECDEC_{role.upper()}_LOG_LEVEL": "warning"}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(address: str, limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with grpc.insecure_channel(address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.3)
    raise TimeoutError(f"{address} not healthy after {limit:.0f} s")


def echo_rtt(rtt_s: float, samples: int = 40) -> float:
    """The median round trip of one byte through a relay set to `rtt_s`, on loopback."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo():
        conn, _ = server.accept()
        while data := conn.recv(64):
            conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    relay = DelayRelay(("127.0.0.1", 0), server.getsockname()[:2], rtt_s)
    sock = socket.create_connection(relay.listen)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        sock.sendall(b"x")
        sock.recv(8)
        times.append(time.perf_counter() - started)
    sock.close()
    relay.close()
    server.close()
    return statistics.median(times)


def measure(stub, requests: int, max_new: int,
            speculation: pb.SpeculationParams | None = None) -> tuple[float, float, list[list[int]], tuple[int, int, int]]:
    """(tokens/s, seconds a pass outside the target's compute, the tokens of each request,
    (target passes, draft tokens, accepted tokens))."""
    tokens, wall, outside, passes, outputs, drafted, accepted = 0, 0.0, 0.0, 0, [], 0, 0
    for i in range(requests):
        prompt = list(PROMPTS[i % len(PROMPTS)].encode())
        started = time.perf_counter()
        response = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new, speculation=speculation),
                                 timeout=300)
        wall += time.perf_counter() - started
        s = response.stats
        tokens += len(response.token_ids)
        outside += max(0.0, s.total_seconds - s.verify_seconds)
        passes += max(1, s.steps)
        drafted, accepted = drafted + s.draft_tokens, accepted + s.accepted_tokens
        outputs.append(list(response.token_ids))
    return tokens / wall, outside / passes, outputs, (passes, drafted, accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rtts-ms", default="0,0.2,0.5,2")
    parser.add_argument("--draft-length", type=int, default=0,
                        help="A fixed draft length every step (the adaptive policy drafts little with the tiny pair); "
                             "0: the default policy")
    args = parser.parse_args()
    reason = namespaces_allowed()
    if reason:
        sys.exit(f"netns_rtt: {reason}")
    rtts = [float(x) / 1000 for x in args.rtts_ms.split(",")]
    net, children, relays = Network(), [], []
    with tempfile.TemporaryDirectory() as folder:
        target_model, draft_model = tinymodels.tiny_pair()
        target_path = tinymodels.save(target_model, pathlib.Path(folder) / "target")
        draft_path = tinymodels.save(draft_model, pathlib.Path(folder) / "draft")
        try:
            net.up()
            host = f"{net.subnet}.1"  # this host: the relays listen here, every service reaches it
            draft_port, target_port = free_port(), free_port()
            relay_draft = DelayRelay((host, 0), (net.address("draft"), draft_port))
            relay_target = DelayRelay((host, 0), (net.address("target"), target_port))
            relays += [relay_draft, relay_target]
            via_draft, via_target = (f"{host}:{relay.listen[1]}" for relay in relays)
            common = ("--device", "cpu", "--metrics-port", "-1")
            children.append(serve(net, "draft", draft_port, "--drafter", "model", "--model", draft_path, *common))
            children.append(serve(net, "target", target_port, "--model", target_path, "--draft", via_draft, *common))
            coordinators = {}
            for path, flags in (("drafted runs", ()), ("steps", ("--no-decode-runs",))):
                port = free_port()
                children.append(serve(net, "coordinator", port, "--target", via_target, "--draft", via_draft, "--tokenizer",
                                      target_path, "--http-port", "-1", "--startup-timeout-s", "180", *flags))
                coordinators[path] = f"{net.address('coordinator')}:{port}"
            for address in (f"{net.address('draft')}:{draft_port}", f"{net.address('target')}:{target_port}", *coordinators.values()):
                wait_healthy(address)
            stubs = {path: pb_grpc.CoordinatorServiceStub(grpc.insecure_channel(address)) for path, address in coordinators.items()}
            for stub in stubs.values():
                measure(stub, 2, 16)  # warm up: connections, streams, the cost model
            base: dict[str, tuple[float, list]] = {}
            speculation = pb.SpeculationParams(draft_length=args.draft_length, adaptive=False) if args.draft_length else None
            print(f"{args.requests} requests x {args.max_new_tokens} tokens a path and round trip, one at a time")
            for rtt in rtts:
                for relay in relays:
                    relay.set_rtt(rtt)
                measured = echo_rtt(rtt)
                for path, stub in stubs.items():
                    rate, outside, outputs, (passes, drafted, accepted) = measure(stub, args.requests, args.max_new_tokens, speculation)
                    first = base.setdefault(path, (rate, outputs))
                    print(f"RTT {rtt * 1e3:.1f} ms (relay measured {measured * 1e3:.2f} ms) {path:>12}: {rate:7.1f} tok/s "
                          f"{rate / first[0]:.2f}x of RTT 0, {outside * 1e3:6.2f} ms a pass outside the target, "
                          f"{passes} passes, {accepted}/{drafted} drafted accepted, "
                          f"tokens {'identical' if outputs == first[1] else 'DIFFER'} to RTT 0", flush=True)
            same = all(outputs == base["steps"][1] for _, outputs in [base["drafted runs"]])
            print(f"drafted runs' tokens {'identical' if same else 'DIFFER from'} the steps' (greedy)")
        finally:
            for child in children:
                child.terminate()
            for child in children:
                try:
                    child.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    child.kill()
            for relay in relays:
                relay.close()
            net.down()


if __name__ == "__main__":
    main()
