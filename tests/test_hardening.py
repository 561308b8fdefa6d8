"""The coordinator under bad input, vanishing clients and a vanishing target, on a real in-process stack.

- A 10 MB prompt is refused (400 past --max-prompt-chars, 413 past --max-body-bytes) while /health
  keeps answering within 100 ms; a prompt under the character limit is tokenized off the event loop.
- Non-streaming requests whose clients disconnect, running or queued, are cancelled at once: the
  running count returns to 0 long before they would have finished, and neither service holds a
  sequence.
- HTTP /health (and the coordinator's gRPC health for its service) says 503 / NOT_SERVING while the
  target is down and ready again once it is back; a missing draft is reported but stays 200.
Figures are printed; run with -s to see them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import socket
import time

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from tests import tiny
from tests.stack import Stack

BIG_CAP = 32 * 1024 * 1024  # the body cap raised so that a 10 MB prompt reaches the prompt checks
# The slowest /health answer allowed while a large request is handled. The stalls these tests catch
# were seconds long (tokenizing 10 MB on the event loop: ~8 s); on a free 2-core machine /health takes
# a few ms, and 0.1 s, the bound before, left a busy or 5x slower machine little room.
HEALTH_BUDGET_S = 0.5
RUNNING = 4  # running slots of the coordinator under test; more requests queue
LONG = 500  # tokens an abandoned request asks for (ignore_eos): prompt + LONG fits the tiny context of 512


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    stack = Stack()
    _, base, _ = stack.tiny_speculative(tmp_path_factory.mktemp("hardening"), served_model_name="tiny", max_body_bytes=BIG_CAP,
                                        max_concurrent_requests=RUNNING, max_queue=64,
                                        max_streams_per_client=64)  # every test client is one peer (127.0.0.1): no per-client cap here
    server = stack.servers[-1]
    # This process runs the servers and the test clients: what holds its GIL stalls them all. A client's
    # set-up (its TLS context) is done here, not while /health is timed, and the objects already made
    # (torch's, transformers', the models') are frozen out of the collector: a full collection of them
    # pauses every thread 200-300 ms on a 2-core machine, which is not what these tests measure.
    gc.collect()
    gc.freeze()
    try:
        with httpx2.Client(base_url=base, timeout=120) as client:
            yield {"stack": stack, "server": server, "base": base, "client": client}
    finally:
        gc.unfreeze()
        stack.stop()


def text_of(chars: int) -> str:
    sentence = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
    return (sentence * (chars // len(sentence) + 1))[:chars]


def while_probing_health(base: str, work) -> tuple[object, list[float]]:
    """Runs `work()` in a thread while GET /health is timed back to back on a kept-alive connection.
    Returns (work's result, every /health latency in seconds)."""
    latencies = []
    with httpx2.Client(base_url=base, timeout=30) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert client.get("/health").status_code == 200  # connected before the work starts
        future = pool.submit(work)
        while not future.done():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)
        return future.result(), latencies


def post(client: httpx2.Client, body) -> httpx2.Response:
    return client.post("/v1/completions", headers={"Content-Type": "application/json"}, content=body)


def assert_envelope(response: httpx2.Response, status: int, param: str, code: str) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["code"] == code, error
    return error


# --- a large prompt must not freeze the coordinator ----------------------------------------------------


def test_a_10mb_prompt_is_refused_and_health_stays_responsive(env):
    """Under the raised body cap the 10 MB prompt reaches the prompt checks: refused by its length
    (--max-prompt-chars) before tokenizing, which took ~8 s on the event loop with /health stalled."""
    body = json.dumps({"prompt": text_of(10_000_000), "max_tokens": 4}).encode()
    started = time.perf_counter()
    response, latencies = while_probing_health(env["base"], lambda: post(env["client"], body))
    elapsed = time.perf_counter() - started
    print(f"\n10 MB prompt: {response.status_code} after {elapsed:.2f}s; {len(latencies)} /health probes meanwhile, "
          f"slowest {max(latencies) * 1000:.1f} ms")
    error = assert_envelope(response, 400, "prompt", "context_length_exceeded")
    assert "characters" in error["message"]
    assert latencies and max(latencies) < HEALTH_BUDGET_S


def test_a_prompt_under_the_character_limit_is_tokenized_off_the_event_loop(env):
    """Just under --max-prompt-chars (1,000,000): tokenized (a million byte tokens, past
    --max-prompt-tokens), in a worker thread, so /health answers meanwhile."""
    body = json.dumps({"prompt": text_of(999_999), "max_tokens": 4}).encode()
    started = time.perf_counter()
    response, latencies = while_probing_health(env["base"], lambda: post(env["client"], body))
    elapsed = time.perf_counter() - started
    print(f"\n1M-character prompt: {response.status_code} after {elapsed:.2f}s; {len(latencies)} /health probes meanwhile, "
          f"slowest {max(latencies) * 1000:.1f} ms")
    error = assert_envelope(response, 400, "prompt", "context_length_exceeded")
    assert "tokens" in error["message"]
    assert len(latencies) >= 3, "the request ended before /health could be timed during it"
    assert max(latencies) < HEALTH_BUDGET_S


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_is_413(env, chunked):
    size = BIG_CAP + 1024 * 1024
    piece = b" " * (1024 * 1024)

    def send():
        if chunked:  # no Content-Length: the cap is enforced while reading
            return post(env["client"], (piece for _ in range(size // len(piece))))
        return post(env["client"], b'{"prompt": "' + b"x" * (size - 30) + b'", "max_tokens": 4}')

    response, latencies = while_probing_health(env["base"], send)
    print(f"\n{size >> 20} MiB body ({'chunked' if chunked else 'Content-Length'}): {response.status_code}; "
          f"slowest /health meanwhile {max(latencies, default=0) * 1000:.1f} ms")
    error = assert_envelope(response, 413, "body", "request_too_large")
    assert str(BIG_CAP) in error["message"]
    assert max(latencies, default=0) < HEALTH_BUDGET_S


# --- vanishing clients ------------------------------------------------------------------------------


def counter(name: str) -> float:
    """A counter's value summed over its labels, from this process's registry (the in-process stack's)."""
    return sum(s.value for family in REGISTRY.collect() for s in family.samples if s.name == name)


def open_request(port: int, body: dict) -> socket.socket:
    """A completion request sent on a raw socket, so the test can drop the connection as a client would."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def wait_for(condition, seconds: float) -> float | None:
    """Seconds until `condition()` held, or None if it did not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if condition():
            return time.monotonic() - started
        time.sleep(0.01)
    return None


def test_abandoned_requests_are_cancelled_running_or_queued(env):
    """Twelve long requests (LONG tokens each, ignore_eos): RUNNING run, the rest queue (two of them
    streamed). Every client then closes its socket without reading a byte."""
    servicer, stack = env["server"].servicer, env["stack"]
    admission = servicer.admission
    generated_before = counter("specdec:generation_tokens_total")
    prompts = tiny.prompts(12, seed=11)
    socks = [open_request(env["server"].http.port, {"prompt": [t % 200 for t in p[:8]], "max_tokens": LONG, "ignore_eos": True,
                                                    "temperature": 0, "stream": i >= 10})
             for i, p in enumerate(prompts)]
    try:
        assert wait_for(lambda: admission.running == RUNNING and admission.queued == len(socks) - RUNNING, 30) is not None, \
            (admission.running, admission.queued)
        time.sleep(0.3)  # the running ones are generating
    finally:
        for sock in socks:
            sock.close()
    freed = wait_for(lambda: admission.running == 0 and admission.queued == 0, 10)  # ~0.1 s on a free 2-core machine

    def held() -> int:
        return sum(len(server.servicer.engine.store) for server in stack.servers[:2])

    released = wait_for(lambda: held() == 0, 10)
    generated = counter("specdec:generation_tokens_total") - generated_before
    print(f"\n12 abandoned requests of {LONG} tokens: slots and queue free {freed}s after the clients left, sequences "
          f"released {released}s later, {generated:.0f} of {12 * LONG} tokens generated")
    assert freed is not None, (admission.running, admission.queued)
    assert released is not None, f"{held()} sequences still held"
    assert 0 < generated < 0.25 * 12 * LONG, "the abandoned requests kept generating"
    assert counter("specdec:num_requests_running") == 0
    # The coordinator still serves.
    response = post(env["client"], json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}).encode())
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


# --- readiness follows the target ---------------------------------------------------------------------


def http_health(base: str) -> tuple[int, dict]:
    response = httpx2.get(f"{base}/health", timeout=10)
    return response.status_code, response.json()


def grpc_health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_follows_the_target_and_reports_the_draft(tmp_path):
    target_model, draft_model = tiny.tiny_pair(seed=0)
    target_path, draft_path = tiny.save(target_model, tmp_path / "target"), tiny.save(draft_model, tmp_path / "draft")
    stack, stack_client = Stack(), None
    try:
        target_addr = stack.target(target_path)
        draft_addr = stack.draft(drafter="model", model=draft_path)
        coordinator = stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer(), http_port=0)
        target_server, draft_server, server = stack.servers
        base = f"http://127.0.0.1:{server.http.port}"
        service = "specdec.v1.CoordinatorService"
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert http_health(base) == (200, {"status": "ok", "target": "ok", "draft": "ok"})
        assert grpc_health(coordinator, service) == serving

        def stop(backend) -> None:
            asyncio.run_coroutine_threadsafe(backend.stop(0), stack.loop).result(timeout=30)

        stop(target_server)
        down = wait_for(lambda: http_health(base)[0] == 503, 10)
        print(f"\ntarget stopped: /health 503 after {down}s")
        assert down is not None, http_health(base)
        assert http_health(base)[1]["status"] == "target unavailable"
        assert grpc_health(coordinator, service) == not_serving
        assert grpc_health(coordinator, "") == serving  # the process is alive: a liveness probe must not restart it

        stack.target(target_path, port=int(target_addr.rsplit(":", 1)[1]))  # the target comes back on its port
        up = wait_for(lambda: http_health(base)[0] == 200, 20)
        print(f"target back: /health 200 after {up}s")
        assert up is not None, http_health(base)
        assert grpc_health(coordinator, service) == serving
        client = stack_client = httpx2.Client(base_url=base, timeout=60)
        response = post(client, json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}).encode())
        assert response.status_code == 200, response.text

        # Without its draft the coordinator still generates (the target alone): reported, still ready.
        stop(draft_server)
        assert wait_for(lambda: http_health(base)[1].get("draft") == "unavailable", 10) is not None, http_health(base)
        assert http_health(base) == (200, {"status": "ok", "target": "ok", "draft": "unavailable"})
        assert grpc_health(coordinator, service) == serving
        assert post(client, json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()).status_code == 200
    finally:
        if stack_client is not None:
            stack_client.close()
        stack.stop()

