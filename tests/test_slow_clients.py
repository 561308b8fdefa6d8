"""Clients that stop reading, and whom the per-client cap counts.

A GenerateStream client that never reads fills gRPC's flow-control window; the coordinator's next
write then waits. It used to wait (holding a running slot and both services' sequences, with the
target idle) until the client's deadline. The stalled clients here open their streams on channels
that announce a small window and never grow it, so the window fills after a few dozen messages
instead of after 64 KiB or more; one message per token (no decoding ahead) makes many messages.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.limits import MAX_LOGPROBS
from tests import tiny
from tests.stack import Stack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A receive window of 1 KiB that BDP probing does not enlarge: a client that reads nothing stalls its
# stream after about twenty 50-byte messages.
STALLING = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
LONG = 480  # tokens: within the tiny models' 512 positions, far more messages than the window holds


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    target, _ = tiny.tiny_pair(seed=0)
    return tiny.save(target, tmp_path_factory.mktemp("slow") / "target")


@pytest.fixture(scope="module")
def long_target_path(tmp_path_factory):
    """A target whose context holds an answer far larger than any socket buffer can take in."""
    return tiny.save(tiny.long_context_target(), tmp_path_factory.mktemp("slow") / "long-target")


# Tokens of the SSE case: its answer (~1 KB a token with its log-probabilities) must overfill what the
# kernel's buffers on both ends can absorb, which on loopback grew past LONG tokens' 300 KB once (the
# whole answer went out and nothing stalled).
SSE_LONG = 4000


def long_stream(address: str, client_id: str = "", authorization: str = "", timeout: float = 60.0):
    """A GenerateStream nobody reads, and its channel (closed by the caller)."""
    channel = grpc.insecure_channel(address, options=STALLING)
    metadata = [(k, v) for k, v in (("x-client-id", client_id), ("authorization", authorization)) if v]
    call = pb_grpc.CoordinatorServiceStub(channel).GenerateStream(
        # With 20 log-probabilities a message (~150 bytes), LONG of them overfill even the 64 KiB window a
        # stream opened before the 1 KiB one took effect had in a clean-clone `make test`: it read 481, all.
        pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=LONG, ignore_eos=True, logprobs=MAX_LOGPROBS),
        timeout=timeout, metadata=metadata)
    return call, channel


@contextlib.contextmanager
def stack_with_streams():
    """A Stack, and `open_stream(address, **long_stream's flags) -> call` for streams nobody reads on
    it; on the way out every stream is cancelled, its channel closed and the stack stopped."""
    stack, opened = Stack(), []

    def open_stream(address: str, **kwargs):
        call, channel = long_stream(address, **kwargs)
        opened.append((call, channel))
        return call

    try:
        yield stack, open_stream
    finally:
        for call, channel in opened:
            call.cancel()
            channel.close()
        stack.stop()


def short(client_id: str = "", authorization: str = "") -> tuple[pb.GenerateRequest, list]:
    metadata = [(k, v) for k, v in (("x-client-id", client_id), ("authorization", authorization)) if v]
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=8), metadata


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def outcome(call) -> tuple[grpc.StatusCode, str, int]:
    """Reads the stream to its end: (status, details, messages received)."""
    received = 0
    try:
        for _ in call:
            received += 1
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", received
    return grpc.StatusCode.OK, "", received


def test_streams_whose_clients_stopped_reading_give_their_slots_back(target_path):
    with stack_with_streams() as (stack, open_stream):
        target = stack.target(target_path)
        coordinator = stack.coordinator(target, "", tiny.byte_tokenizer(), max_concurrent_requests=2, decode_ahead=0,
                                        stream_stall_timeout_s=1.0, client_id_header="x-client-id")
        held = stack.servers[0].servicer.engine.store
        stalled = [open_stream(coordinator, client_id=f"stopped-reading-{i}") for i in range(2)]
        assert wait_for(lambda: len(held) == 2, 10), "the two streams never ran"
        started = time.monotonic()
        request, metadata = short(client_id="reads-its-answers")
        answer = stack.client(coordinator).Generate(request, timeout=15, metadata=metadata)  # queued behind the two
        waited = time.monotonic() - started
        ends = [outcome(call) for call in stalled]
        print(f"\ntwo streams that stopped reading, 2 running slots, 1 s stall timeout: a third client's request "
              f"answered after {waited:.1f}s; the stalled streams ended {[(c.name, n) for c, _, n in ends]}")
        assert len(answer.token_ids) == 8
        for code, details, received in ends:
            assert code == grpc.StatusCode.CANCELLED and "stopped reading" in details
            assert received < LONG, "the stream was never stalled"
        assert wait_for(lambda: len(held) == 0, 10), "the stalled streams' sequences were not released"


def test_the_per_client_cap_counts_clients_not_bearer_tokens(target_path):
    """Keyed by the Authorization header, every client of --api-token shared one cap, and without
    a token any made-up value was a client of its own. The streams held here stall (no reading, no
    stall timeout), so each holds its place for as long as the test needs."""
    with stack_with_streams() as (stack, open_stream):
        target = stack.target(target_path)
        by_peer = stack.coordinator(target, "", tiny.byte_tokenizer(), max_streams_per_client=1, decode_ahead=0,
                                    stream_stall_timeout_s=0)
        by_header = stack.coordinator(target, "", tiny.byte_tokenizer(), max_streams_per_client=1, decode_ahead=0,
                                      stream_stall_timeout_s=0, client_id_header="X-Client-Id")
        running = [server.servicer.admission for server in stack.servers[1:]]

        open_stream(by_peer, authorization="Bearer made-up-1")
        assert wait_for(lambda: running[0].running == 1, 10)
        request, metadata = short(authorization="Bearer made-up-2")
        with pytest.raises(grpc.RpcError) as refused:
            stack.client(by_peer).Generate(request, timeout=15, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, "another made-up token bypassed the cap"

        open_stream(by_header, client_id="alice")
        assert wait_for(lambda: running[1].running == 1, 10)
        request, metadata = short(client_id="bob")
        assert len(stack.client(by_header).Generate(request, timeout=15, metadata=metadata).token_ids) == 8
        request, metadata = short(client_id="alice")
        with pytest.raises(grpc.RpcError) as refused:
            stack.client(by_header).Generate(request, timeout=15, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def post(url: str, client_id: str) -> int:
    """The status of a small completion sent with a made-up bearer token as `client_id`."""
    request = urllib.request.Request(url, method="POST", data=json.dumps({"prompt": "hello", "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer made-up-2",
                                              "x-client-id": client_id})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_http_requests_count_against_the_same_clients(target_path):
    """The HTTP API names clients with the same function: a made-up Authorization header is no
    new client there either, and --client-id-header separates clients."""
    with stack_with_streams() as (stack, open_stream):
        target = stack.target(target_path)
        stack.coordinator(target, "", tiny.byte_tokenizer(), max_streams_per_client=1, decode_ahead=0,
                          stream_stall_timeout_s=0, client_id_header="x-client-id", http_port=0)
        server = stack.servers[-1]
        address, url = f"127.0.0.1:{server.port}", f"http://127.0.0.1:{server.http.port}/v1/completions"
        open_stream(address, client_id="alice", authorization="Bearer made-up-1")
        assert wait_for(lambda: server.servicer.admission.running == 1, 10)
        assert post(url, client_id="alice") == 429
        assert post(url, client_id="bob") == 200


def dechunked(data: bytes) -> tuple[bytes, bool]:
    """An HTTP/1.1 chunked body as received: (the chunks' bytes, whether its terminating chunk came)."""
    body, rest = b"", data
    while b"\r\n" in rest:
        size, _, rest = rest.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            return body, True
        body, rest = body + rest[:length], rest[length + 2:]
    return body, False


def test_a_server_sent_events_stream_whose_client_stopped_reading_is_dropped(long_target_path):
    """docs/deploy.md says a stream cut for stalling is dropped. It used to end with a clean chunked
    terminator on a connection kept alive (the bearer-token middleware finished the response the
    stalled stream left unfinished): a client that read on got a truncated completion with no
    `[DONE]` and no error, as if it were whole."""
    stack = Stack()
    sock = socket.socket()
    try:
        target = stack.target(long_target_path)
        stack.coordinator(target, "", tiny.byte_tokenizer(), decode_ahead=0, stream_stall_timeout_s=1.0, http_port=0)
        held = stack.servers[0].servicer.engine.store
        # Before connecting, what the client announces: a small window, and a small segment size, which
        # keeps the server's send buffer small (Linux sizes it by segments: at loopback's 64 KiB ones
        # it grew to megabytes, past the whole 300 KB response, which then never stalled).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        sock.connect(("127.0.0.1", stack.servers[-1].http.port))
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": SSE_LONG, "ignore_eos": True, "logprobs": MAX_LOGPROBS,
                           "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = sock.recv(1024)
        assert received.startswith(b"HTTP/1.1 200"), received
        assert wait_for(lambda: len(held) == 1, 10), "the stream never ran"
        assert wait_for(lambda: len(held) == 0, 30), "the stalled stream's sequence was not released"
        sock.settimeout(3)  # the client reads on, for less than uvicorn's 5 s keep-alive: is the connection closed?
        closed = False
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                received += chunk
            closed = True
    finally:
        sock.close()
        stack.stop()
    events, finished = dechunked(received.partition(b"\r\n\r\n")[2])
    assert b"data: " in events and b'"finish_reason": "length"' not in events, "the stream was never stalled"
    assert not finished, "the response was ended cleanly, as if the completion were whole"
    assert closed, "the connection was left open"
    assert b"[DONE]" not in events


def test_one_client_holds_no_more_than_the_running_slots_by_default():
    """The cap used to default to 64 beside 32 running slots: one client could hold every slot and
    queue more. By default it now follows --max-concurrent-requests; a value set wins."""
    from coordinator.config import CoordinatorConfig
    from coordinator.policy.admission import client_key, grpc_peer_host

    assert CoordinatorConfig().streams_per_client() == CoordinatorConfig().max_concurrent_requests
    assert CoordinatorConfig(max_concurrent_requests=2).streams_per_client() == 2
    assert CoordinatorConfig(max_concurrent_requests=2, max_streams_per_client=5).streams_per_client() == 5
    assert CoordinatorConfig(max_concurrent_requests=0).streams_per_client() == 0  # no limit on either
    with pytest.raises(ValueError):
        CoordinatorConfig(client_id_header="x client id")
    # gRPC peers and HTTP hosts name the same client: the address without the port
    assert client_key(grpc_peer_host("ipv4:10.0.0.7:54321")) == client_key("10.0.0.7") != client_key("10.0.0.8")
    assert grpc_peer_host("ipv6:[::1]:54321") == "::1"
    assert client_key("10.0.0.7", "alice") != client_key("10.0.0.7", "bob")


def test_a_server_sent_events_stream_whose_client_stopped_reading_ends():
    """The HTTP stream's writes (uvicorn's send waits while TCP flow control holds it) past the stall
    timeout close the events' iterator, as the request's clean-up needs, and the response returns
    unfinished instead of waiting for the client."""
    import asyncio

    from coordinator.http_replies import StallingStream

    closed, sent = asyncio.Event(), []

    async def events():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    async def send(message):
        sent.append(message)
        if len(sent) > 3:  # the client's window is full: this write never completes
            await asyncio.Event().wait()

    async def receive():
        await asyncio.Event().wait()  # the client says nothing (it has not disconnected either)

    async def run() -> float:
        started = time.monotonic()
        await asyncio.wait_for(StallingStream(events(), 0.2, media_type="text/event-stream")({"type": "http"}, receive, send), 10)
        return time.monotonic() - started

    waited = asyncio.run(run())
    assert closed.is_set() and 0.2 <= waited < 5
    assert len(sent) == 4 and not any(m.get("more_body") is False for m in sent)
