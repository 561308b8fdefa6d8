"""Multi-host: draft, target and coordinator each on its own host (a network namespace), real links.

Topology, one /24 per run (10.77.K.0/24, K picked so no other run's routes collide):

    test host (root namespace) --- coordinator ---+--- draft      point-to-point veth links, /30 each;
       10.77.K.1           10.77.K.2  .5 |  .9    |  10.77.K.6   the coordinator's namespace forwards,
                                         |        +--- target     so the test host also reaches the
                                         +------------ 10.77.K.10 draft and target (health checks)

The services are real `specdec serve` subprocesses started inside their namespaces on tiny models.
The tests then cut the coordinator's links (`ip link set down`), limit a link's bandwidth
(`tc ... tbf`) and kill and restart the target, and check the outcome of every request. Figures are
printed (run with -s). Skipped where namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`).
"""

from __future__ import annotations

import concurrent.futures
import queue
import re
import shutil
import time
import urllib.request

import grpc
import pytest

from coordinator.clients import TARGET_RETRY_S
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests import tiny
from specdec_tools.netns import Network, namespaces_allowed
from tests.services import Service, free_port, healthy

MAX_NEW = 24
RPC_TIMEOUT_S = 3.0  # the coordinator's deadline per internal call: how long a dead link can stall a step
# Three services and the test share this machine's cores: one thread each, or OpenMP's spinning
# threads fight over the cores and a tiny model's forward pass slows from milliseconds to 100s of ms.
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = namespaces_allowed()
    if reason:
        pytest.skip(f"multi-host test skipped: {reason}")
    target_model, draft_model = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("netns")
    target_path, draft_path = tiny.save(target_model, folder / "target"), tiny.save(draft_model, folder / "draft")
    net = Network()
    services: list[Service] = []
    channel = None
    try:
        net.up()
        common = ("--device", "cpu", "--metrics-port", "-1")
        metrics_port = free_port()  # the target's sequence gauge, read from this host (test f)
        target = Service(
            "target", "--model", target_path, "--device", "cpu", "--metrics-port", str(metrics_port),
            netns=net.ns["target"], host=net.address("target"), env=ENV,
        )
        draft = Service(
            "draft", "--drafter", "model", "--model", draft_path, *common, netns=net.ns["draft"], host=net.address("draft"), env=ENV
        )
        coordinator = Service(
            "coordinator",
            *("--target", target.address, "--draft", draft.address, "--tokenizer", target_path, "--http-port", "-1"),
            *("--rpc-timeout-s", str(RPC_TIMEOUT_S), "--startup-timeout-s", "120"),
            netns=net.ns["coordinator"],
            host=net.address("coordinator"),
            env=ENV,
        )
        started = time.monotonic()
        for service in (target, draft, coordinator):
            services.append(service.start(wait=0))
        for service in services:
            service.wait_healthy(120)
        print(
            f"\nnamespaces {sorted(net.ns.values())} on {net.subnet}.0/24: three services healthy after {time.monotonic() - started:.1f}s"
        )
        channel = grpc.insecure_channel(coordinator.address)
        stub = pb_grpc.CoordinatorServiceStub(channel)
        yield {"net": net, "stub": stub, "model": target_model, "target": target, "draft": draft, "coordinator": coordinator,
               "target_metrics": f"http://{net.address('target')}:{metrics_port}/metrics"}
    finally:
        if channel is not None:
            channel.close()
        for service in services:
            service.stop()
        net.down()


def request(prompt: list[int], max_new: int = MAX_NEW) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new, speculation=pb.SpeculationParams(draft_length=4, adaptive=False)
    )


def run(stub, prompts, timeout: float, max_new: int = MAX_NEW, during=None, concurrent: bool = True):
    """Sends the prompts (all at once, or one after another); `during()` runs once they are in flight.

    Returns ([("ok", response) or (status code, seconds until it failed)], wall seconds).
    """
    started = time.monotonic()

    def one(prompt):
        t0 = time.monotonic()
        try:
            return "ok", stub.Generate(request(prompt, max_new), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), time.monotonic() - t0

    if not concurrent:
        return [one(p) for p in prompts], time.monotonic() - started
    with concurrent_pool(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        if during is not None:
            time.sleep(0.5)
            during()
        return [f.result() for f in futures], time.monotonic() - started


def concurrent_pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max(n, 1))


def identical(hosts, prompts, outcomes, max_new: int = MAX_NEW) -> int:
    return sum(
        1
        for p, (kind, r) in zip(prompts, outcomes)
        if kind == "ok" and list(r.token_ids) == tiny.reference_greedy(hosts["model"], p, max_new)
    )


def tokens_of(outcomes) -> int:
    return sum(len(r.token_ids) for kind, r in outcomes if kind == "ok")


def wait_for_success(stub, prompt, limit: float) -> tuple[float, pb.GenerateResponse | None]:
    """Sends the prompt until a request succeeds; (seconds it took, the response or None)."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            return time.monotonic() - started, stub.Generate(request(prompt), timeout=10)
        except grpc.RpcError:
            time.sleep(0.2)
    return time.monotonic() - started, None


def test_a_greedy_across_hosts_is_identical_to_the_target_alone(hosts):
    prompts = tiny.prompts(8, seed=11)
    outcomes, wall = run(hosts["stub"], prompts, timeout=60, concurrent=False)
    same = identical(hosts, prompts, outcomes)
    drafted = sum(r.stats.draft_tokens for kind, r in outcomes if kind == "ok")
    accepted = sum(r.stats.accepted_tokens for kind, r in outcomes if kind == "ok")
    wire = sum(r.stats.wire_bytes for kind, r in outcomes if kind == "ok")
    print(
        f"\n(a) greedy across three hosts: {same}/{len(prompts)} identical to the target alone, {tokens_of(outcomes)} tokens "
        f"at {tokens_of(outcomes) / wall:.0f} tokens/s, {accepted}/{drafted} drafts accepted, {wire / max(tokens_of(outcomes), 1):.0f} wire bytes/token"
    )
    assert same == len(prompts)
    assert 0 < accepted < drafted, "speculation across the hosts did not happen"


def test_b_draft_link_cut_falls_back_then_speculation_resumes(hosts):
    net, stub = hosts["net"], hosts["stub"]
    prompts = tiny.prompts(10, seed=12)
    try:
        outcomes, wall = run(stub, prompts, timeout=60, during=lambda: net.cut("draft"))
    finally:
        net.restore("draft")
    same = identical(hosts, prompts, outcomes)
    others = [kind.name if kind != "ok" else "OK but different" for kind, _ in outcomes if kind != "ok"]
    print(
        f"\n(b) coordinator<->draft link cut during {len(prompts)} concurrent requests: {same}/{len(prompts)} completed identical "
        f"(target alone after the draft's calls timed out), in {wall:.1f}s{f'; other outcomes: {others}' if others else ''}"
    )
    assert same == len(prompts)
    # Back up: speculation resumes once the coordinator retries the draft and TCP recovers.
    started, accepted, resumed = time.monotonic(), 0, []
    while not accepted and time.monotonic() - started < 30:
        prompt = tiny.prompts(1, seed=13 + len(resumed))[0]
        response = stub.Generate(request(prompt), timeout=60)
        assert list(response.token_ids) == tiny.reference_greedy(hosts["model"], prompt, MAX_NEW)
        resumed.append(response)
        accepted = response.stats.accepted_tokens
    print(
        f"    link restored: speculation resumed after {time.monotonic() - started:.1f}s ({len(resumed)} requests, "
        f"{accepted} drafts accepted in the last), every output identical"
    )
    assert accepted > 0, "speculation did not resume once the link was back"


def test_c_bandwidth_limit_slows_but_keeps_output_identical(hosts):
    if shutil.which("tc") is None:
        pytest.skip("`tc` (iproute2) is not installed")
    net, stub = hosts["net"], hosts["stub"]
    prompts = tiny.prompts(4, seed=14)
    free, free_wall = run(stub, prompts, timeout=60, concurrent=False)
    net.limit("target", "24kbit")
    try:
        limited, limited_wall = run(stub, prompts, timeout=60, concurrent=False)
    finally:
        net.unlimit("target")
    free_rate, limited_rate = tokens_of(free) / free_wall, tokens_of(limited) / limited_wall
    same = identical(hosts, prompts, limited)
    print(
        f"\n(c) coordinator<->target link limited to 24 kbit/s (tc tbf): {same}/{len(prompts)} identical; "
        f"{free_rate:.0f} tokens/s unlimited, {limited_rate:.0f} tokens/s limited"
    )
    assert identical(hosts, prompts, free) == same == len(prompts)
    assert limited_rate < free_rate, "the bandwidth limit had no effect"


def test_d_target_link_cut_fails_within_deadline_then_recovers(hosts):
    net, stub = hosts["net"], hosts["stub"]
    prompts = tiny.prompts(6, seed=15)
    deadline = 20.0
    late: list = []

    def cut():
        net.cut("target")
        late.extend(run(stub, prompts[:2], timeout=deadline, max_new=400)[0])  # sent while the link is down

    try:
        outcomes, wall = run(stub, prompts, timeout=deadline, max_new=400, during=cut)
    finally:
        net.restore("target")
    everything = outcomes + late
    codes = [kind for kind, _ in everything]
    slowest = max(elapsed for kind, elapsed in everything if kind != "ok")
    print(
        f"\n(d) coordinator<->target link cut: {len(everything)} requests (incl. {len(late)} sent during the cut) ended "
        f"{ {c.name if c != 'ok' else 'OK': codes.count(c) for c in set(codes)} }, slowest failure after {slowest:.1f}s "
        f"(deadline {deadline:.0f}s)"
    )
    assert all(kind in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) for kind in codes)
    assert slowest < deadline + 1.0, "a request outlived its deadline"
    took, response = wait_for_success(stub, prompts[0], limit=45)
    assert response is not None, f"requests still fail {took:.0f}s after the link came back"
    outcomes, _ = run(stub, prompts, timeout=60)
    same = identical(hosts, prompts, outcomes)
    print(f"    link restored: first success after {took:.1f}s, then {same}/{len(prompts)} concurrent requests identical")
    assert same == len(prompts)


def test_e_target_killed_and_restarted_in_its_namespace(hosts):
    stub, target = hosts["stub"], hosts["target"]
    prompts = tiny.prompts(10, seed=16)
    deadline = 30.0

    killed: list[float] = []

    def restart():
        target.kill()
        killed.append(time.monotonic())
        target.start(wait=0)

    outcomes, wall = run(stub, prompts, timeout=deadline, during=restart)
    target.wait_healthy(120)
    restart_s = time.monotonic() - killed[0]  # an upper bound: the requests may have ended later
    same = identical(hosts, prompts, outcomes)
    failed = [elapsed for kind, elapsed in outcomes if kind in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)]
    print(
        f"\n(e) target killed and restarted in its namespace during {len(prompts)} requests: {same} completed identical, "
        f"{len(failed)} failed UNAVAILABLE/DEADLINE_EXCEEDED (slowest after {max(failed, default=0):.1f}s, deadline {deadline:.0f}s), "
        f"{len(prompts) - same - len(failed)} other"
    )
    print(
        f"    the target was back within {restart_s:.1f}s of the kill; the coordinator retries an unavailable target for {TARGET_RETRY_S:.0f}s"
    )
    assert same + len(failed) == len(prompts)
    assert all(elapsed < deadline + 1.0 for elapsed in failed)
    if restart_s < TARGET_RETRY_S - 4:  # a quick restart (with reconnection time to spare): requests ride through it
        assert same == len(prompts), "requests failed although the target came back within the retry budget"
    took, response = wait_for_success(stub, prompts[0], limit=30)
    assert response is not None and list(response.token_ids) == tiny.reference_greedy(hosts["model"], prompts[0], MAX_NEW)
    assert took < 5.0, "the coordinator took long to reconnect to the restarted target (reconnect back-off)"
    assert healthy(hosts["coordinator"].address)
    print(f"    restarted target serving: first success after {took:.1f}s, identical")


def target_sequences(hosts) -> int:
    text = urllib.request.urlopen(hosts["target_metrics"], timeout=5).read().decode()
    return int(float(re.search(r"^specdec:target_num_sequences (\S+)$", text, re.M).group(1)))


@pytest.mark.slow  # test-all: the suite's time (issue 58); waits out the keepalive timeouts
def test_f_a_peer_that_vanishes_without_a_reset_has_its_sequences_freed(hosts):
    """A host that vanishes sends no reset: the target's keepalive pings find it (specdec/serving/rpc.py
    KEEPALIVE_OPTIONS), its session stream ends, and the sequence it carried is freed
    (specdec/serving/carriers.py) in well under the --idle-timeout-s sweep (600 s)."""
    from specdec.serving.carriers import GRACE_S
    from specdec.serving.rpc import KEEPALIVE_OPTIONS

    net = hosts["net"]
    options = dict(KEEPALIVE_OPTIONS)
    found_within = (options["grpc.keepalive_time_ms"] + options["grpc.keepalive_timeout_ms"]) / 1000 + GRACE_S
    before = target_sequences(hosts)
    channel = grpc.insecure_channel(hosts["target"].address)  # this host is the peer that vanishes
    requests: queue.Queue = queue.Queue()
    try:
        session = pb_grpc.TargetServiceStub(channel).VerifySession(iter(requests.get, None), timeout=600)
        requests.put(pb.VerifySessionRequest(verify=pb.VerifyRequest(sequence_id="vanishing", append_tokens=[1, 2, 3])))
        assert next(session).verify.cached_len == 3
        assert target_sequences(hosts) == before + 1
        net.cut("target")  # the target's packets to this host go nowhere; no reset, no FIN reaches it
        cut = time.monotonic()
        try:
            time.sleep(found_within + 2.0)
        finally:
            net.restore("target")
        freed = None
        while time.monotonic() - cut < found_within + 30.0:
            try:
                if target_sequences(hosts) == before:
                    freed = time.monotonic() - cut
                    break
            except OSError:  # the route back settles a moment after the link is up
                pass
            time.sleep(0.5)
        print(f"\n(f) a peer gone without a reset: its sequence freed {freed:.1f}s after the cut (keepalive + grace {found_within:.0f}s)")
        assert freed is not None, "the vanished peer's sequence is still held"
    finally:
        requests.put(None)
        channel.close()
