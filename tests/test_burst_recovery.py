"""Speculation comes back after a cold start under a burst.

A fresh coordinator whose first requests came as 10 concurrent streams then drafted nothing for
every later single request, for minutes: the shared cost model's first readings were batched
passes (the very first one padded to another row's prefill), the priors' seconds were fixed by that
one reading, so V(n > 1) stood far above the V(1) of a single stream, every n-gram proposal was cut
to nothing, and each such step decoded ahead without being observed, so the estimates never moved.
Here, through the real services (the target's continuous batcher makes the burst's passes batched),
with the default coordinator flags and prompt lookup in the coordinator.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from protos import specdec_pb2 as pb
from tests import tiny
from tests.stack import Stack

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_drafting_resumes_for_single_requests_after_a_cold_start_burst(tmp_path):
    model = tiny.looping_target()
    stack = Stack()
    try:
        target = stack.target(tiny.save(model, tmp_path / "target"))
        stub = stack.client(stack.coordinator(target, "ngram", tiny.byte_tokenizer()))
        prompts = tiny.prompts(14, seed=7)

        def generate(prompt, max_new_tokens):
            return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new_tokens,
                                                    ignore_eos=True), timeout=120)

        with concurrent.futures.ThreadPoolExecutor(10) as pool:  # the cold start: ten streams at once
            list(pool.map(lambda p: generate(p, 128), prompts[:10]))
        singles = [generate(p, 64) for p in prompts[10:]]  # then one at a time
        counts = [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in singles]
        print(f"\nafter a burst of 10 streams, single requests' (drafted, accepted): {counts}")
        assert sum(d for d, _ in counts[:3]) > 0 and sum(a for _, a in counts[:3]) > 0, "speculation stayed off"
    finally:
        stack.stop()
