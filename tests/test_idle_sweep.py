"""Idle sequences are freed on a timer, not only when the next call happens to come.

A coordinator that is SIGKILLed sends no Release and no further call; its sequences used to stay in
the target's and the draft's caches (and in their sequence gauges) until some other call ran the
store's expiry. Here sequences are created with direct calls, then nothing is sent at all.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from draft_service.config import DraftConfig
from draft_service.servicer import serve as serve_draft
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from target_service.config import TargetConfig
from target_service.servicer import serve as serve_target
from tests import tiny

IDLE_TIMEOUT_S = 1.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target, draft = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("idle")
    return tiny.save(target, folder / "target"), tiny.save(draft, folder / "draft")


async def _start(serve, config):
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(config, ready=ready, signals=False))
    done, _ = await asyncio.wait({ready, task}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    return ready.result(), task


async def _held_after_silence(server, gauge: str, seconds: float) -> tuple[list[int], list[float]]:
    """The store's size and the gauge, sampled while no call reaches the server."""
    store = server.servicer.engine.store
    sizes, gauges = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sizes.append(len(store))
        gauges.append(REGISTRY.get_sample_value(gauge))
        if not sizes[-1]:
            break
        await asyncio.sleep(0.1)
    return sizes, gauges


async def _stop(server, task) -> None:
    await server.stop(0)
    await asyncio.wait_for(task, 30)
    await asyncio.sleep(0.05)  # a cancelled task ends at its next turn
    left = [t for t in asyncio.all_tasks() if t.get_name().endswith("idle-sweep") and not t.done()]
    assert not left, "the idle sweep outlived its server"


def test_the_target_frees_idle_sequences_with_no_call_arriving(paths):
    async def main():
        config = TargetConfig(port=0, metrics_port=-1, model=paths[0], device="cpu", idle_timeout_s=IDLE_TIMEOUT_S)
        server, task = await _start(serve_target, config)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = pb_grpc.TargetServiceStub(channel)
                for i in range(3):
                    await stub.Verify(pb.VerifyRequest(sequence_id=f"vanished-{i}", known_len=0, append_tokens=[1, 2, 3 + i]))
            assert len(server.servicer.engine.store) == 3
            assert REGISTRY.get_sample_value("specdec:target_num_sequences") == 3
            # The coordinator is gone: not one more call.
            return await _held_after_silence(server, "specdec:target_num_sequences", IDLE_TIMEOUT_S + 4)
        finally:
            await _stop(server, task)

    sizes, gauges = asyncio.run(main())
    print(f"\ntarget, idle timeout {IDLE_TIMEOUT_S:.0f}s, no calls: sequences held {sizes[0]} -> {sizes[-1]} "
          f"after {0.1 * (len(sizes) - 1):.1f}s")
    assert sizes[-1] == 0, "idle sequences stayed until a call came"
    assert gauges[-1] == 0, "specdec:target_num_sequences did not fall with the store"


def test_the_draft_frees_idle_sequences_with_no_call_arriving(paths):
    async def main():
        config = DraftConfig(port=0, metrics_port=-1, drafter="model", model=paths[1], device="cpu", idle_timeout_s=IDLE_TIMEOUT_S)
        server, task = await _start(serve_draft, config)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = pb_grpc.DraftServiceStub(channel)
                for i in range(2):
                    async for _ in stub.Propose(pb.ProposeRequest(sequence_id=f"vanished-{i}", known_len=0,
                                                                  append_tokens=[4, 5, 6 + i], max_tokens=2)):
                        pass
            assert len(server.servicer.engine.store) == 2
            assert REGISTRY.get_sample_value("specdec:draft_num_sequences") == 2
            return await _held_after_silence(server, "specdec:draft_num_sequences", IDLE_TIMEOUT_S + 4)
        finally:
            await _stop(server, task)

    sizes, gauges = asyncio.run(main())
    assert sizes[-1] == 0, "idle sequences stayed until a call came"
    assert gauges[-1] == 0, "specdec:draft_num_sequences did not fall with the store"
