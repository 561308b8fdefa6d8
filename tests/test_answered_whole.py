"""A request answered whole (GenerationSpec.answered_whole: a unary Generate, a non-streamed HTTP
completion, without stop strings): its client sees no token before the last, so after the first
token the target decodes ahead as far as the request allows, in one exchange, instead of
--decode-ahead passes an exchange.

The tokens must be the target's own either way; the exchanges must fall; a streamed request, or
one with stop strings, must keep its bursts; and the long run of passes decoded ahead must stop
once other work waits for the target's worker (a Release, another sequence's call).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from coordinator.loop import DEFAULT_DECODE_AHEAD, SpeculativeLoop
from specdec.limits import MAX_DECODE_AHEAD
from specdec.spec.costs import MODEL_DRAFT_PRIOR
from specdec.spec.request import VerifyCall
from tests import tiny
from tests.test_lookup_ahead import GREEDY, RecordingVerifier, echoing_prompts, engine, ngram_loop
from tests.test_loop import run

MAX_NEW = 40  # several bursts of DEFAULT_DECODE_AHEAD + 1 passes when streamed


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=5)


@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "speculation-off"])
def test_a_request_answered_whole_takes_two_exchanges_for_the_same_tokens(pair, lookup):
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
        # The first token alone (its time is the request's TTFT), then the rest in one exchange.
        assert len(calls[True]) <= 2 and calls[True][0].decode_ahead == 0
        if len(reference) == MAX_NEW:  # no end-of-sequence token came first
            full += 1
            assert len(calls[True]) == 2 and calls[True][1].decode_ahead == MAX_NEW - 2  # every token left but the call's own
            assert calls[True][1].decode_ahead_passes == (MAX_DECODE_AHEAD if lookup else 0)
            assert len(calls[False]) > 2 and all(c.decode_ahead_passes in (0, DEFAULT_DECODE_AHEAD) for c in calls[False])
    assert full


@pytest.fixture(scope="module")
def ngram_stack(pair, tmp_path_factory):
    """A target and a coordinator drafting n-grams (the target by lookup), with the HTTP API."""
    from tests.stack import Stack

    stack = Stack()
    # No idle sweep: a sweep queued for the worker (every 30 s) stops a run decoded ahead, as any
    # waiting work does, which would add an exchange to the counts compared below.
    address, base = stack.tiny_ngram(tiny.save(pair[0], tmp_path_factory.mktemp("whole") / "target"), {"idle_timeout_s": 0})
    yield stack, stack.client(address), base
    stack.stop()


def test_through_the_services_unary_and_unstreamed_http_take_fewer_exchanges_than_a_stream(ngram_stack):
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
    assert unary_n == 2 < streamed_n
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

    assert http(stream=False) == 2 < http(stream=True)


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
