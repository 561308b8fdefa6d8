"""A coordinator that dies frees its sequences in both services within seconds
(specdec/serving/carriers.py): the end of the session streams that carried them is the signal.

What must hold: a coordinator killed mid-request (SIGKILL: no Release, no cancel sent) leaves no
KV cache held in the target or the draft past the grace; a sequence whose stream a live coordinator
closed and re-opened (a dropped run-ahead, a failed step) is not freed under it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from coordinator.clients import DraftClient, TargetClient
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.calls.request import ProposeCall, VerifyCall
from specdec.maths.sampling import SamplingConfig
from tests import tiny
from tests.services import Service
from tests.stack import Stack

GRACE_S = 1.0


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """A target and a model draft in this process (their stores inspected), with a short grace."""
    folder = tmp_path_factory.mktemp("carriers")
    target_model, draft_model = tiny.tiny_pair(seed=3)
    target_path = str(tiny.save(target_model, folder / "target"))
    stack = Stack()
    target = stack.target(target_path)
    draft = stack.draft(drafter="model", model=str(tiny.save(draft_model, folder / "draft")))
    for server in stack.servers:
        server.servicer.carriers.grace_s = GRACE_S
    yield stack, target, draft, target_path
    stack.stop()


def stores(stack):
    return [server.servicer.engine.store for server in stack.servers]


def wait_empty(stack, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(len(store) for store in stores(stack)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [len(store) for store in stores(stack)]


def test_a_killed_coordinator_frees_its_sequences_in_both_services(backends):
    stack, target, draft, target_path = backends
    coordinator = Service("coordinator", "--target", target, "--draft", draft, "--tokenizer", target_path, "--http-port", "-1",
                          "--startup-timeout-s", "120").start()
    channel = grpc.insecure_channel(coordinator.address)
    try:
        stub = pb_grpc.CoordinatorServiceStub(channel)
        calls = [stub.GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=400,
                                                              ignore_eos=True), timeout=120)
                 for prompt in tiny.prompts(3, seed=4)]
        for call in calls:
            next(call)  # every request is generating: both services hold its sequence
        held = [len(store) for store in stores(stack)]
        assert held == [3, 3]
        coordinator.kill()
        assert wait_empty(stack, GRACE_S + 5.0) == [0, 0], "a killed coordinator's sequences stayed held"
    finally:
        channel.close()
        coordinator.kill()


def test_a_stream_closed_and_reopened_keeps_its_sequence(backends):
    stack, target, draft, _ = backends
    prompt = tiny.prompts(1, seed=7)[0]

    async def steps():
        target_client, draft_client = TargetClient(target, 10.0), DraftClient(draft, 10.0)
        try:
            first = await target_client.verify(VerifyCall("kept", 0, list(prompt), [], [], SamplingConfig()))
            await draft_client.propose(ProposeCall("kept", 0, list(prompt), 3, 0.0, 0.0, 0))
            target_client.sessions.close("kept")  # as a failed step or a dropped run-ahead closes it
            draft_client.sessions.close("kept")
            await asyncio.sleep(GRACE_S / 4)
            tokens = [*prompt, first.next_token]
            second = await target_client.verify(VerifyCall("kept", len(prompt), tokens[len(prompt):], [], [], SamplingConfig()))
            await draft_client.propose(ProposeCall("kept", len(prompt), tokens[len(prompt):], 3, 0.0, 0.0, 0))
            await asyncio.sleep(GRACE_S * 2)  # past the first stream's grace: the new streams carry it
            held = [len(store) for store in stores(stack)]
            await target_client.release("kept")
            await draft_client.release("kept")
            return second, held
        finally:
            await target_client.close()
            await draft_client.close()

    second, held = asyncio.run_coroutine_threadsafe(steps(), stack.loop).result(60)
    assert second.next_token >= 0
    assert held == [1, 1], "a sequence a live coordinator still steps was freed"
    assert wait_empty(stack, 5.0) == [0, 0]
