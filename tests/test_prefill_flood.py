"""Long prompts cannot hold every running slot (issue 55; coordinator/policy/admission.py).

Three running slots, three long prompts sent first and a short one right after them: before the
partial-prefill bounds, the long prompts took every slot and the short request waited in the queue
until one of them had been prefilled and decoded whole. Now one long prompt is prefilled at
a time, the others wait without a slot, the short request starts at once and is done before the
first long one (which asks for more tokens), the long ones reach their first token in the order they came, and every output is
the target's own greedy tokens.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from protos import specdec_pb2 as pb
from tests import tiny
from tests.stack import Stack

LONG_TOKENS = 1500  # six of the target's default 256-token prefill chunks
MAX_NEW = 8  # the short request's; the long ones decode LONG_NEW, so they end after it only if it is not made to wait
LONG_NEW = 48


@pytest.fixture(scope="module")
def flood(tmp_path_factory):
    target = tiny.long_context_target(layers=2, context=4096)
    stack = Stack()
    address, _ = stack.tiny_ngram(tiny.save(target, tmp_path_factory.mktemp("flood") / "target"),
                                  max_concurrent_requests=3, max_num_partial_prefills=1, max_long_partial_prefills=1,
                                  long_prefill_token_threshold=512, max_streams_per_client=8)
    yield stack.client(address), target
    stack.stop()


def test_a_short_request_passes_long_prompts_that_wait_their_turn(flood):
    stub, target = flood
    prompts = tiny.prompts(4, seed=11)
    longs = [(p * (LONG_TOKENS // len(p) + 1))[:LONG_TOKENS] for p in prompts[:3]]
    short = prompts[3]
    events: dict[str, dict[str, float]] = {}
    lock = threading.Lock()
    start = time.monotonic()

    def run(name: str, ids: list[int], max_new: int) -> list[int]:
        tokens: list[int] = []
        request = pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=max_new)
        for response in stub.GenerateStream(request, timeout=120):
            with lock:
                events.setdefault(name, {}).setdefault("first", time.monotonic() - start)
            tokens += response.token_ids
        with lock:
            events[name]["done"] = time.monotonic() - start
        return tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {}
        for i, ids in enumerate(longs):
            futures[f"long{i}"] = pool.submit(run, f"long{i}", ids, LONG_NEW)
            time.sleep(0.02)  # their order of arrival is known
        futures["short"] = pool.submit(run, "short", short, MAX_NEW)
        outputs = {name: future.result() for name, future in futures.items()}

    assert events["short"]["done"] < events["long0"]["done"], f"the short request waited for a long one: {events}"
    assert events["long0"]["first"] < events["long1"]["first"] < events["long2"]["first"], events
    for name, ids, max_new in [*((f"long{i}", ids, LONG_NEW) for i, ids in enumerate(longs)), ("short", short, MAX_NEW)]:
        assert outputs[name] == tiny.reference_greedy(target, ids, max_new), name
