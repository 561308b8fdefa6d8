"""The coordinator's sessions (VerifySession, ProposeSession): one open stream per sequence answers
exactly as the per-step calls do, closes with the sequence, and fails each exchange the way a
per-step call would fail."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.clients import DraftClient, TargetClient
from specdec.errors import SequenceNotFound
from specdec.maths.sampling import SamplingConfig
from specdec.maths.tree import EMPTY_DIST
from specdec.calls.request import ProposeCall, VerifyCall
from tests import tiny
from tests.stack import Stack


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    model, draft = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("session")
    stack = Stack()
    yield {"target": stack.target(tiny.save(model, folder / "target")),
           "draft": stack.draft(drafter="model", model=tiny.save(draft, folder / "draft"), max_batch_size=1)}
    stack.stop()


@pytest.fixture()
def target(services):
    return services["target"]


async def _steps(client: TargetClient, sequence_id: str, prompt: list[int], steps: int = 6) -> list[tuple[int, int]]:
    """Greedy steps that always propose the same three tokens: some accepted, most not."""
    out = await client.verify(VerifyCall(sequence_id, 0, prompt, [], [], SamplingConfig()))
    known, verdicts = len(prompt), [(out.accepted, out.next_token)]
    for _ in range(steps):
        out = await client.verify(VerifyCall(sequence_id, known, [out.next_token], [5, 6, 7], [EMPTY_DIST] * 3, SamplingConfig()))
        known += 1 + out.accepted
        verdicts.append((out.accepted, out.next_token))
    return verdicts


def test_a_session_answers_as_unary_calls_and_closes_with_the_sequence(target):
    async def main():
        client = TargetClient(target, timeout_s=30)
        try:
            prompt = tiny.prompts(1, seed=3)[0]
            streamed = await _steps(client, "streamed", prompt)
            assert "streamed" in client.sessions and len(client.sessions) == 1
            client.sessions.enabled = False
            unary = await _steps(client, "unary", prompt)
            assert len(client.sessions) == 1  # unary calls opened none
            await client.release("streamed")
            assert not len(client.sessions)
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
                await client.verify(VerifyCall("never-made", 5, [1], [], [], SamplingConfig()))
            assert not len(client.sessions)
            await _steps(client, "after", tiny.prompts(1, seed=4)[0], steps=1)  # ...and the next call opens a new one
            client.timeout_s = 1e-4  # no answer comes back this fast: the exchange times out as a unary call would
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.verify(VerifyCall("after", 0, [1, 2, 3], [], [], SamplingConfig()))
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "after" not in client.sessions  # a late answer must not be read as the next call's
        finally:
            await client.close()

    asyncio.run(main())


def test_a_propose_session_answers_as_the_stream_does(services):
    """Greedy and seeded sampling (whose distributions travel too), with a rollback between calls;
    a run-ahead (which watches tokens arrive) keeps the per-token stream."""
    prompt = tiny.prompts(1, seed=6)[0]

    async def calls(client: DraftClient, sequence_id: str, temperature: float) -> list:
        out = []
        first = await client.propose(ProposeCall(sequence_id, 0, prompt, 6, 0.0, temperature, 9))
        second = await client.propose(ProposeCall(sequence_id, len(prompt), first.tokens[:2] + [4], 6, 0.0, temperature, 10))
        for outcome in (first, second):
            out.append((outcome.tokens, outcome.confidence, outcome.dists))
        opened = sequence_id in client.sessions
        await client.release(sequence_id)
        return out, opened

    async def main():
        client = DraftClient(services["draft"], timeout_s=30)
        try:
            for temperature in (0.0, 0.8):
                session, opened = await calls(client, f"session-{temperature}", temperature)
                assert opened and not len(client.sessions)  # a stream for the sequence's life, closed on release
                client.sessions.enabled = False
                streamed, opened = await calls(client, f"stream-{temperature}", temperature)
                client.sessions.enabled = True
                assert not opened
                assert session == streamed and all(len(tokens) == 6 for tokens, _, _ in session)
                assert all(ids for _, _, dists in session for ids, _ in dists) == (temperature > 0)
        finally:
            await client.close()

    asyncio.run(main())


def test_a_propose_session_counts_the_forward_that_proposed_nothing(services):
    """A chain stops on a forward whose token falls under the threshold; that forward is draft time.
    A stream cannot say so (no token, no message), so over it the time used to count as wire."""
    prompt = tiny.prompts(1, seed=8)[0]

    async def main():
        client = DraftClient(services["draft"], timeout_s=30)
        try:
            outcomes = []
            for enabled in (True, False):
                client.sessions.enabled = enabled
                sequence_id = f"shy-{enabled}"
                # min_cumulative_prob 1: any token the draft is not certain of is not sent
                outcomes.append(await client.propose(ProposeCall(sequence_id, 0, prompt, 4, 1.0, 0.0, 0)))
                await client.release(sequence_id)
            return outcomes
        finally:
            await client.close()

    session, stream = asyncio.run(main())
    assert session.tokens == stream.tokens == []
    assert 0 < session.compute_seconds <= session.wall_seconds
    assert stream.compute_seconds == 0.0


@pytest.mark.parametrize("details, retried", [("Stream removed", True), ("something else", False)])
def test_a_stream_removed_by_a_connection_reset_is_retried_like_unavailable(target, details, retried):
    """gRPC can report a connection reset on a stream as UNKNOWN "Stream removed" (grpc/grpc#34076):
    Verify retries it as it retries UNAVAILABLE; any other UNKNOWN still fails at once."""
    async def main():
        client = TargetClient(target, timeout_s=30)
        real, calls = client.sessions.exchange, []

        async def reset_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
            return await real(*args, **kwargs)

        client.sessions.exchange = reset_once
        try:
            prompt = tiny.prompts(1, seed=5)[0]
            if not retried:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await client.verify(VerifyCall("reset", 0, prompt, [], [], SamplingConfig()))
                assert failed.value.code() == grpc.StatusCode.UNKNOWN and len(calls) == 1
                return
            out = await client.verify(VerifyCall("reset", 0, prompt, [], [], SamplingConfig()))
            assert len(calls) == 2 and out.next_token == tiny.reference_greedy(tiny.tiny_pair(seed=0)[0], prompt, 1)[0]
        finally:
            await client.close()

    asyncio.run(main())
