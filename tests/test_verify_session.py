"""The coordinator's VerifySession: one open stream per sequence answers exactly as unary Verify
calls do, closes with the sequence, and fails each exchange the way a unary call would fail."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.clients import TargetClient
from specdec.errors import SequenceNotFound
from specdec.sampling import SamplingConfig
from tests import tiny
from tests.stack import Stack


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model, _ = tiny.tiny_pair(seed=0)
    stack = Stack()
    yield stack.target(tiny.save(model, tmp_path_factory.mktemp("session") / "target"))
    stack.stop()


async def _steps(client: TargetClient, sequence_id: str, prompt: list[int], steps: int = 6) -> list[tuple[int, int]]:
    """Greedy steps that always propose the same three tokens: some accepted, most not."""
    out = await client.verify(sequence_id, 0, prompt, [], [], SamplingConfig())
    known, verdicts = len(prompt), [(out.accepted, out.next_token)]
    for _ in range(steps):
        out = await client.verify(sequence_id, known, [out.next_token], [5, 6, 7], [None] * 3, SamplingConfig())
        known += 1 + out.accepted
        verdicts.append((out.accepted, out.next_token))
    return verdicts


def test_a_session_answers_as_unary_calls_and_closes_with_the_sequence(target):
    async def main():
        client = TargetClient(target, timeout_s=30)
        try:
            prompt = tiny.prompts(1, seed=3)[0]
            streamed = await _steps(client, "streamed", prompt)
            assert list(client._sessions) == ["streamed"]
            client.sessions = False
            unary = await _steps(client, "unary", prompt)
            assert list(client._sessions) == ["streamed"]  # unary calls opened none
            await client.release("streamed")
            assert not client._sessions
            return streamed, unary
        finally:
            await client.close()

    streamed, unary = asyncio.run(main())
    assert streamed == unary


def test_a_failed_exchange_fails_like_a_unary_call_and_drops_its_stream(target):
    async def main():
        client = TargetClient(target, timeout_s=30)
        try:
            with pytest.raises(SequenceNotFound):  # NOT_FOUND ends the stream...
                await client.verify("never-made", 5, [1], [], [], SamplingConfig())
            assert not client._sessions
            await _steps(client, "after", tiny.prompts(1, seed=4)[0], steps=1)  # ...and the next call opens a new one
            client.timeout_s = 1e-4  # no answer comes back this fast: the exchange times out as a unary call would
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.verify("after", 0, [1, 2, 3], [], [], SamplingConfig())
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "after" not in client._sessions  # a late answer must not be read as the next call's
        finally:
            await client.close()

    asyncio.run(main())
