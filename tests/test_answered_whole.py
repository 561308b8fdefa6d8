"""A request answered whole (GenerationSpec.answered_whole: a unary Generate, a non-streamed HTTP
completion, without stop strings): its client sees no token before the last, so the prompt's
exchange goes on decoding as far as the request allows: one exchange, instead of bursts of
--decode-ahead passes after a first token of its own.

The tokens must be the target's own either way; the exchanges must fall; a streamed request, or
one with stop strings, must keep its bursts; and the long run of passes decoded ahead must stop
once other work waits for the target's worker (a Release, another sequence's call).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from coordinator.loop import DEFAULT_DECODE_AHEAD, SpeculativeLoop
from specdec.limits import MAX_DECODE_AHEAD
from specdec.maths.costs import MODEL_DRAFT_PRIOR
from specdec.calls.request import VerifyCall
from tests import tiny
from tests.test_hardening import counter
from tests.test_lookup_ahead import GREEDY, RecordingVerifier, echoing_prompts, engine, ngram_loop
from tests.test_loop import run

MAX_NEW = 40  # several bursts of DEFAULT_DECODE_AHEAD + 1 passes when streamed


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=5)


@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "speculation-off"])
def test_a_request_answered_whole_takes_one_exchange_for_the_same_tokens(pair, lookup):
    target = engine(pair)
    full = 0
    for prompt in echoing_prompts(pair, 4):
        reference = tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        calls = {}
        for whole in (False, True):
            verifier = RecordingVerifier(target)
            loop = ngram_loop(verifier, lookup=True) if lookup else SpeculativeLoop(verifier, None, None, MODEL_DRAFT_PRIOR)
            tokens, stats = run(loop, prompt, max_new=MAX_NEW, draft_length=8 if lookup else 0, answered_whole=whole)
            assert tokens == reference
            calls[whole] = verifier.calls
        # The prompt's exchange decodes every token left after its own: the whole request.
        assert len(calls[True]) == 1 and calls[True][0].decode_ahead == MAX_NEW - 1
        assert calls[True][0].decode_ahead_passes == (MAX_DECODE_AHEAD if lookup else 0)
        if len(reference) == MAX_NEW:  # no end-of-sequence token came first
            full += 1
            assert len(calls[False]) > 2 and all(c.decode_ahead_passes in (0, DEFAULT_DECODE_AHEAD) for c in calls[False])
            # A stream's first exchange is its prompt's pass alone: its first token goes out at once.
            assert calls[False][0].decode_ahead == 0
    assert full


@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "speculation-off"])
def test_the_first_token_of_a_request_answered_whole_is_timed_at_its_own_pass(pair, lookup):
    """Its exchange goes on decoding after the prompt's pass, so the step that brings the first
    token brings them all; the first token's time (TTFT) and the first step's tokens are still the
    prompt pass's own, as the target reports them (ahead_seconds, ahead_tokens)."""
    target = engine(pair)
    prompt = echoing_prompts(pair, 1)[0]
    verifier = RecordingVerifier(target)
    loop = ngram_loop(verifier, lookup=True) if lookup else SpeculativeLoop(verifier, None, None, MODEL_DRAFT_PRIOR)
    tokens, stats = run(loop, prompt, max_new=MAX_NEW, draft_length=8 if lookup else 0, answered_whole=True)
    outcome = verifier.outcomes[0]
    assert outcome.ahead_tokens > 0 and 0 < outcome.ahead_seconds < outcome.compute_seconds
    own = 1 + len(outcome.decoded) - outcome.ahead_tokens  # next_token and the lookup tokens its own pass accepted
    assert stats.first_step_tokens == min(own, len(tokens)) and stats.first_step_tokens < len(tokens)
    assert 0 < stats.time_to_first_token_seconds < stats.total_seconds - 0.9 * outcome.ahead_seconds


@pytest.fixture(scope="module")
def ngram_stack(pair, tmp_path_factory):
    """A target and a coordinator drafting n-grams (the target by lookup), with the HTTP API."""
    from tests.stack import Stack

    stack = Stack()
    # No idle sweep: a sweep queued for the worker (every 30 s) stops a run decoded ahead, as any
    # waiting work does, which would add an exchange to the counts compared below.
    # Verify exchanges, not runs in the target (--decode-runs): a run streams every pass in one call
    # whether answered whole or not (tests/test_decode_runs.py).
    address, base = stack.tiny_ngram(tiny.save(pair[0], tmp_path_factory.mktemp("whole") / "target"), {"idle_timeout_s": 0},
                                     decode_runs=False)
    yield stack, stack.client(address), base
    stack.stop()


def test_through_the_services_unary_and_unstreamed_http_take_one_exchange(ngram_stack):
    import json
    import urllib.request

    from protos import specdec_pb2 as pb

    stack, client, base = ngram_stack
    batcher = stack.servers[0].servicer.batcher  # the target's: one batch per Verify exchange here

    def exchanges(send) -> tuple[list[int], int]:
        before = batcher.batches
        tokens = send()
        return tokens, batcher.batches - before

    params = dict(text="hello there", max_new_tokens=MAX_NEW, ignore_eos=True)
    unary, unary_n = exchanges(lambda: list(client.Generate(pb.GenerateRequest(**params), timeout=60).token_ids))
    streamed, streamed_n = exchanges(lambda: [t for r in client.GenerateStream(pb.GenerateStreamRequest(**params), timeout=60)
                                              for t in r.token_ids])
    assert unary == streamed and len(unary) == MAX_NEW
    assert unary_n == 1 < streamed_n
    # Stop strings are looked for as the tokens come: a stop string nobody meets keeps the bursts.
    stopped, stopped_n = exchanges(lambda: list(client.Generate(pb.GenerateRequest(**params, stop=["\x00never"]), timeout=60).token_ids))
    assert stopped == unary and stopped_n == streamed_n

    def http(stream: bool) -> int:
        body = {"prompt": "hello there", "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "stream": stream}
        request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        before = batcher.batches
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
        return batcher.batches - before

    assert http(stream=False) == 1 < http(stream=True)


ITL_COUNT = "specdec:inter_token_latency_seconds_count"
TTFT_COUNT = "specdec:time_to_first_token_seconds_count"


def _settled() -> None:
    """Waits until no request runs: a streamed request before this test may still be recording
    its metrics after its client read the last chunk."""
    for _ in range(200):
        if counter("specdec:num_requests_running") == 0:
            return
        time.sleep(0.05)


def test_a_unary_request_s_metrics_keep_its_first_token_apart(ngram_stack):
    """One exchange brings every token, yet the request's TTFT is its prompt pass's, and only the
    tokens after that pass's count as inter-token gaps (a gap each, over the time after the first)."""
    from protos import specdec_pb2 as pb

    _, client, _ = ngram_stack
    _settled()
    itl, ttft = counter(ITL_COUNT), counter(TTFT_COUNT)
    response = client.Generate(pb.GenerateRequest(text="hello there", max_new_tokens=MAX_NEW, ignore_eos=True), timeout=60)
    stats = response.stats
    assert len(response.token_ids) == MAX_NEW and 1 <= stats.first_step_tokens < MAX_NEW
    assert counter(TTFT_COUNT) - ttft == 1
    assert counter(ITL_COUNT) - itl == MAX_NEW - stats.first_step_tokens
    assert 0 < stats.time_to_first_token_seconds < stats.total_seconds


def test_work_waiting_for_the_worker_stops_the_passes_decoded_ahead(pair):
    """A Release (or any call for the worker) queued behind a long run of passes decoded ahead stops
    it after the pass under way, so it waits one pass, not the whole request."""
    from target_service.servicer import TargetServicer

    prompt = tiny.prompts(1, seed=7)[0]

    async def main(queue_behind: bool):
        servicer = TargetServicer()
        servicer.host.attach(engine(pair), None)
        gate = threading.Event()

        def held():
            gate.wait(timeout=30)  # the worker holds the call until the release is queued behind it
            return servicer._verify_batch([VerifyCall("long", 0, prompt, [], [], GREEDY, decode_ahead=16)])

        running = asyncio.ensure_future(servicer.host.run(held))
        await asyncio.sleep(0)  # submitted to the worker
        released = asyncio.ensure_future(servicer.host.run(servicer.engine.release, "other")) if queue_behind else None
        await asyncio.sleep(0)
        gate.set()
        result = (await running)[0]
        if released is not None:
            assert await released is False  # no such sequence: it only had to run
        servicer.host.executor.shutdown()
        return result

    alone, interrupted = asyncio.run(main(False)), asyncio.run(main(True))
    assert len(alone.decoded) == 16 or tiny.EOS in alone.decoded
    assert interrupted.ahead_passes == 0 and interrupted.next_token == alone.next_token
