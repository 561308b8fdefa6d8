"""What /metrics says about a real stack (target, model draft, coordinator in one process on loopback).

The gauges of sequences held must follow the services' stores both ways: up while a request runs
and back to 0 once every request has ended (they used to stay at 1: set after each Verify or
Propose, never on Release). The request histograms split a request's time into queue, prefill and
decode, and the coordinator's request metrics carry the served model's name, as vLLM's do.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from coordinator.config import CoordinatorConfig
from protos import specdec_pb2 as pb
from tests import tiny
from tests.stack import Stack

MAX_SEQUENCES = 8
MODEL = CoordinatorConfig().tokenizer  # the model name the HTTP API reports, and the metrics' label


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target, draft = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("metrics")
    stack = Stack()
    target_addr = stack.target(tiny.save(target, folder / "target"), max_sequences=MAX_SEQUENCES)
    draft_addr = stack.draft(drafter="model", model=tiny.save(draft, folder / "draft"), max_sequences=MAX_SEQUENCES)
    coordinator = stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer())
    stores = [server.servicer.engine.store for server in stack.servers[:2]]  # the target's and the draft's
    yield {"client": stack.client(coordinator), "stores": stores}
    stack.stop()


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def held() -> dict[str, float]:
    return {name: value(name) for name in ("specdec:target_num_sequences", "specdec:draft_num_sequences",
                                           "specdec:target_kv_cache_usage_perc", "specdec:draft_kv_cache_usage_perc")}


def settled(expected: float, timeout: float = 10.0) -> dict[str, float]:
    """The gauges once they equal `expected` (a release may still be on the wire), or as they are at the timeout."""
    deadline = time.monotonic() + timeout
    while (now := held()) and any(v != expected for v in now.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_sequence_gauges_rise_during_a_request_and_return_to_zero_after(env):
    client = env["client"]
    started = value("specdec:target_sequences_started_total")
    for prompt in tiny.prompts(3, seed=5):
        response = client.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=12), timeout=60)
        assert response.stats.completion_tokens > 0
        assert [len(store) for store in env["stores"]] == [0, 0]  # released: nothing leaks ...
        assert settled(0.0) == dict.fromkeys(held(), 0.0)  # ... and the gauges say so
    assert value("specdec:target_sequences_started_total") - started == 3  # the requests did reach the target

    # While a stream is open its sequence is held in both services: 1 of MAX_SEQUENCES.
    stream = client.GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=tiny.prompts(1, seed=6)[0]),
                                                         max_new_tokens=200), timeout=60)
    for _ in zip(range(20), stream):  # the first step may be the target's alone: wait for a draft step
        if [len(store) for store in env["stores"]] == [1, 1]:
            break
    during = held()
    assert [len(store) for store in env["stores"]] == [1, 1]
    stream.cancel()
    assert during["specdec:target_num_sequences"] == during["specdec:draft_num_sequences"] == 1
    assert during["specdec:target_kv_cache_usage_perc"] == during["specdec:draft_kv_cache_usage_perc"] == 1 / MAX_SEQUENCES
    assert settled(0.0) == dict.fromkeys(held(), 0.0)  # a cancelled request releases too


def test_request_time_is_split_into_queue_prefill_and_decode(env):
    names = ("specdec:request_queue_time_seconds", "specdec:request_prefill_time_seconds",
             "specdec:request_decode_time_seconds", "specdec:e2e_request_latency_seconds")
    before = {n: (value(f"{n}_count", model_name=MODEL), value(f"{n}_sum", model_name=MODEL)) for n in names}
    response = env["client"].Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=tiny.prompts(1, seed=7)[0]), max_new_tokens=16), timeout=60)
    stats = response.stats
    after = {n: (value(f"{n}_count", model_name=MODEL), value(f"{n}_sum", model_name=MODEL)) for n in names}
    count = {n: after[n][0] - before[n][0] for n in names}
    added = {n: after[n][1] - before[n][1] for n in names}
    assert count == dict.fromkeys(names, 1.0)
    assert added["specdec:request_prefill_time_seconds"] == pytest.approx(stats.time_to_first_token_seconds)
    assert added["specdec:request_decode_time_seconds"] == pytest.approx(stats.total_seconds - stats.time_to_first_token_seconds)
    assert added["specdec:request_prefill_time_seconds"] + added["specdec:request_decode_time_seconds"] == pytest.approx(
        added["specdec:e2e_request_latency_seconds"])
    assert 0 <= added["specdec:request_queue_time_seconds"] < stats.total_seconds  # nothing else was running: no wait
    # Every request-level series carries the model the coordinator serves (its --tokenizer).
    assert value("specdec:request_success_total", model_name=MODEL, finished_reason="length") > 0
    assert value("specdec:generation_tokens_total", model_name=MODEL) > 0


def test_store_gauges_follow_evictions_releases_and_idle_expiry(monkeypatch):
    """The paths no request of the stack test takes: an eviction at capacity, an idle expiry."""
    from prometheus_client import CollectorRegistry, Gauge

    from specdec.errors import SequenceNotFound
    from specdec.kv import store as store_module
    from specdec.serving import metrics

    registry = CollectorRegistry()
    sequences, usage = Gauge("sequences", "", registry=registry), Gauge("usage", "", registry=registry)
    store = store_module.SequenceStore(max_sequences=2, idle_timeout_s=30.0)
    metrics.follow_store(store, sequences, usage)
    read = lambda: (registry.get_sample_value("sequences"), registry.get_sample_value("usage"))  # noqa: E731
    assert read() == (0, 0)
    store.sync("a", 0, [1, 2])
    store.sync("b", 0, [1, 2])
    assert read() == (2, 1.0)
    store.sync("c", 0, [1, 2])  # evicts "a": still full
    assert read() == (2, 1.0) and "a" not in store
    assert store.release("b") and read() == (1, 0.5)
    assert not store.release("b") and read() == (1, 0.5)
    now = time.monotonic()
    monkeypatch.setattr(store_module.time, "monotonic", lambda: now + 60)  # "c" has been idle past the timeout
    with pytest.raises(SequenceNotFound):  # the next call to reach the store expires "c" first
        store.sync("c", 2, [3])
    assert len(store) == 0 and read() == (0, 0)


def test_observe_many_records_what_as_many_observes_would():
    """A step's burst of tokens is recorded in one update (specdec.serving.metrics.observe_many):
    the histogram must read as if each token had been observed."""
    from prometheus_client import CollectorRegistry, Histogram

    from specdec.serving.metrics import LATENCY_BUCKETS, observe_many

    registry = CollectorRegistry()
    one, many = (Histogram(name, "test", buckets=LATENCY_BUCKETS, registry=registry) for name in ("one", "many"))
    for value, count in ((0.0042, 127), (0.03, 3), (1e9, 2), (0.0, 1)):
        for _ in range(count):
            one.observe(value)
        observe_many(many, value, count)

    def samples(name: str) -> dict:
        return {(s.name.removeprefix(name), tuple(sorted(s.labels.items()))): round(s.value, 9)
                for metric in registry.collect() if metric.name == name for s in metric.samples if not s.name.endswith("_created")}

    assert samples("one") == samples("many") and samples("one")[("_count", ())] == 133
