"""Health and graceful shutdown of real `specdec serve` subprocesses.

  * Health says NOT_SERVING from the moment the port is bound until the model is loaded and warmed
    (a coordinator: until its backends answer), and calls meanwhile get UNAVAILABLE.
  * SIGTERM: health turns NOT_SERVING at once (and keeps answering), new calls are refused with
    UNAVAILABLE, calls in flight complete, and the process exits 0 as soon as they have, well within
    the grace period; past the grace period what is left is cancelled and the process still exits.
Figures are printed (run with -s).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests import tiny
from tests.services import Service, free_port
from tests.stack import Stack

GRACE_S = 8.0
MARGIN_S = 5.0  # after the server stops: interpreter teardown with torch loaded takes 1-3 s on a busy 2-core box
ENV = {"OMP_NUM_THREADS": "1"}  # the test and the services share two cores
SHUTTING_DOWN = "the server is shutting down"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("shutdown")
    return target, tiny.save(target, folder / "target"), tiny.save(draft, folder / "draft")


def health(address: str) -> str:
    """SERVING / NOT_SERVING, or the status code of a failed check (UNAVAILABLE: nothing listening)."""
    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def watch_startup(service: Service, probe, limit: float = 120.0) -> list[tuple[float, str]]:
    """Polls health from launch until SERVING; while NOT_SERVING, `probe()` must fail UNAVAILABLE.

    Returns the distinct states seen, with the second each was first seen.
    """
    started = time.monotonic()
    seen: list[tuple[float, str]] = []
    while time.monotonic() - started < limit:
        state = health(service.address)
        if not seen or seen[-1][1] != state:
            seen.append((round(time.monotonic() - started, 2), state))
        if state == "SERVING":
            return seen
        if state == "NOT_SERVING":
            try:
                probe()
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            else:  # allowed only if the service turned SERVING between the check and the call
                assert health(service.address) == "SERVING", "a call succeeded while health said NOT_SERVING"
        assert service.process.poll() is None, f"{service.role} exited with {service.process.returncode}"
        time.sleep(0.02)
    raise TimeoutError(f"{service.role} not SERVING after {limit}s: {seen}")


def test_target_not_serving_until_loaded_and_warmed_then_drains_on_sigterm(models):
    _, target_path, _ = models
    target = Service("target", "--model", target_path, "--device", "cpu", "--metrics-port", "-1", "--grace-s", str(GRACE_S), env=ENV)
    channel = None
    try:
        target.start(wait=0)
        channel = grpc.insecure_channel(target.address)
        stub = pb_grpc.TargetServiceStub(channel)
        seen = watch_startup(target, lambda: stub.GetInfo(pb.TargetServiceGetInfoRequest(), timeout=5))
        states = [state for _, state in seen]
        assert "NOT_SERVING" in states and states[-1] == "SERVING" and states.index("NOT_SERVING") < states.index("SERVING")
        # SERVING means usable at once: the model is attached and its first forward already ran.
        first = stub.Verify(pb.VerifyRequest(sequence_id="first", append_tokens=[1, 2, 3], draft_tokens=[4]), timeout=5)
        assert first.compute_seconds < 0.5, f"the first call after SERVING paid for a warm-up ({first.compute_seconds:.2f}s)"
        print(f"\ntarget start-up, health by second: {seen}; first call after SERVING took {first.compute_seconds * 1000:.1f} ms")

        # Many long calls queue on the target's one model thread; SIGTERM while they are in flight.
        prompt = [t % 256 for t in range(479)]  # + 32 draft tokens: the tiny model's whole context
        calls = [
            stub.Verify.future(pb.VerifyRequest(sequence_id=f"s{i}", append_tokens=prompt, draft_tokens=prompt[:32]), timeout=60)
            for i in range(32)  # about a quarter of the grace period of work on a busy 2-core box
        ]
        # A VerifySession (the coordinator's one stream per sequence) open across the signal.
        requests: queue.Queue = queue.Queue()
        session = stub.VerifySession(iter(requests.get, None), timeout=60)
        requests.put(pb.VerifySessionRequest(verify=pb.VerifyRequest(sequence_id="session", append_tokens=[1, 2, 3])))
        assert next(session).verify.cached_len == 3
        # The target is working through them once one is answered: whichever, since under load
        # they need not run in the order sent (waiting for calls[0] alone once left none in flight).
        deadline = time.monotonic() + 60
        while not any(c.done() for c in calls) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)  # every call has reached the server by now
        target.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        in_flight = sum(1 for c in calls if not c.done())  # the calls the drain must let finish
        states = []
        while time.monotonic() - signalled < 0.5:
            states.append(health(target.address))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Verify(pb.VerifyRequest(sequence_id="late", append_tokens=[1, 2]), timeout=5)
        # The open session's next request is refused like a new call: it must not hold the drain up.
        requests.put(pb.VerifySessionRequest(verify=pb.VerifyRequest(sequence_id="session", known_len=3, append_tokens=[4])))
        with pytest.raises(grpc.RpcError) as ended:
            next(session)
        requests.put(None)
        results = [c.result() for c in calls]  # raises if any in-flight call failed
        drained = time.monotonic() - signalled
        code = target.process.wait(timeout=GRACE_S + MARGIN_S)
        exited = time.monotonic() - signalled
        print(
            f"target SIGTERM: health {sorted(set(states))} within 0.5s, new call {refused.value.code().name}, "
            f"{len(results)}/{len(calls)} calls completed ({in_flight} in flight at the signal) in {drained:.2f}s, "
            f"exit code {code} after {exited:.2f}s (grace {GRACE_S:.0f}s)"
        )
        assert set(states) == {"NOT_SERVING"}, states
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in refused.value.details()
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in ended.value.details()
        assert in_flight > 0 and all(r.cached_len >= len(prompt) for r in results)
        assert drained < GRACE_S and code == 0 and exited < GRACE_S + MARGIN_S
    finally:
        if channel is not None:
            channel.close()
        target.stop()


@pytest.fixture(scope="module")
def backends(models):
    target_model, target_path, draft_path = models
    stack = Stack()
    draft = stack.draft(drafter="model", model=draft_path)
    target_port = free_port()
    yield {"stack": stack, "model": target_model, "target_path": target_path, "target_port": target_port, "draft": draft, "target": None}
    stack.stop()


def start_target(backends) -> None:
    """The coordinators' target, started late: the first test shows a coordinator waiting for it."""
    if backends["target"] is None:
        backends["target"] = backends["stack"].target(backends["target_path"], port=backends["target_port"])


def coordinator(backends, grace: float) -> Service:
    return Service(
        "coordinator",
        *("--target", f"127.0.0.1:{backends['target_port']}", "--draft", backends["draft"], "--tokenizer", backends["target_path"]),
        *("--http-port", "-1", "--grace-s", str(grace)),
        env=ENV,
    )


def held(backends) -> int:
    return sum(len(server.servicer.engine.store) for server in backends["stack"].servers)


def wait_free(backends, limit: float = 10.0) -> int:
    deadline = time.monotonic() + limit
    while held(backends) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held(backends)


def stream(stub, prompt, max_new: int):
    return stub.GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new), timeout=60)


def test_coordinator_not_serving_until_backends_then_streams_drain_on_sigterm(backends):
    service = coordinator(backends, GRACE_S)
    channel = None
    try:
        service.start(wait=0)
        channel = grpc.insecure_channel(service.address)
        stub = pb_grpc.CoordinatorServiceStub(channel)
        # No target yet: the coordinator stays NOT_SERVING (and refuses requests) until it answers.
        started = time.monotonic()
        while health(service.address) != "NOT_SERVING":
            assert time.monotonic() - started < 60, "the coordinator never bound its port"
            time.sleep(0.05)
        time.sleep(1.0)
        assert health(service.address) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as early:
            stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=2), timeout=5)
        assert early.value.code() == grpc.StatusCode.UNAVAILABLE
        start_target(backends)
        seen = watch_startup(service, lambda: stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=2), timeout=5))
        print(f"\ncoordinator without its target: NOT_SERVING, requests {early.value.code().name}; target started: {seen}")

        prompts = tiny.prompts(4, seed=21)
        streams = [stream(stub, p, 200) for p in prompts]
        firsts = [next(s) for s in streams]  # all four running
        service.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        states = []
        while time.monotonic() - signalled < 0.3:
            states.append(health(service.address))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=2), timeout=5)
        outputs = [list(first.token_ids) + [t for m in s for t in m.token_ids] for first, s in zip(firsts, streams)]
        drained = time.monotonic() - signalled
        code = service.process.wait(timeout=GRACE_S + MARGIN_S)
        exited = time.monotonic() - signalled
        same = sum(1 for p, out in zip(prompts, outputs) if out == tiny.reference_greedy(backends["model"], p, 200))
        print(
            f"coordinator SIGTERM with {len(streams)} streams running: health {sorted(set(states))}, new request "
            f"{refused.value.code().name}, {same}/{len(streams)} streams completed identical in {drained:.2f}s, "
            f"exit code {code} after {exited:.2f}s (grace {GRACE_S:.0f}s), {wait_free(backends)} sequences left in the backends"
        )
        assert set(states) == {"NOT_SERVING"}, states
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in refused.value.details()
        assert same == len(streams)
        assert drained < GRACE_S and code == 0 and exited < GRACE_S + MARGIN_S
        assert wait_free(backends) == 0
    finally:
        if channel is not None:
            channel.close()
        service.stop()


def test_coordinator_past_its_grace_cancels_what_is_left_and_exits(backends):
    # Short enough that streams of 400 tokens (near the tiny model's 512 context) are still running
    # when it ends: with OpenMP's spin fixed, the tiny services decode 4 x 400 tokens in about 0.5 s.
    grace = 0.1
    start_target(backends)
    service = coordinator(backends, grace)
    channel = None
    try:
        service.start()
        channel = grpc.insecure_channel(service.address)
        stub = pb_grpc.CoordinatorServiceStub(channel)
        streams = [stream(stub, p, 400) for p in tiny.prompts(4, seed=22)]
        for s in streams:
            next(s)
        service.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        codes = []
        for s in streams:
            with pytest.raises(grpc.RpcError) as info:
                list(s)
            codes.append(info.value.code())
        cut = time.monotonic() - signalled
        code = service.process.wait(timeout=grace + MARGIN_S)
        exited = time.monotonic() - signalled
        left = wait_free(backends)
        print(
            f"\ncoordinator SIGTERM, grace {grace}s, streams of 400 tokens: ended {sorted({c.name for c in codes})} "
            f"after {cut:.2f}s, exit code {code} after {exited:.2f}s, {left} sequences left in the backends"
        )
        assert all(c in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE) for c in codes)
        assert code == 0 and exited < grace + MARGIN_S
        assert left == 0, "cancelled requests left their sequences in the backends"
    finally:
        if channel is not None:
            channel.close()
        service.stop()


@pytest.mark.parametrize("role, flags", [
    ("target", ["--model", "no-such-model", "--metrics-port", "-1"]),
    ("draft", ["--drafter", "model", "--model", "/no/such/folder", "--metrics-port", "-1"]),
    ("coordinator", ["--target", "127.0.0.1:1", "--tokenizer", "no-such-tokenizer", "--http-port", "-1"]),
])
def test_a_bad_model_ends_the_service_with_its_message_not_a_traceback(role, flags):
    done = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "serve", role, "--port", str(free_port()), *flags],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"specdec serve {role}: error:" in done.stderr and ("no-such" in done.stderr or "/no/such" in done.stderr)
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-2000:]
