"""An n-gram Propose with a short catch-up is answered on the event loop while the engine's worker is
idle (draft_service/servicer.py, DraftEngine.answers_inline): no thread hop each way. Everything
else, and everything while the worker has work, still goes to the worker, so the engine is never
touched from two threads at once."""

from __future__ import annotations

import asyncio
import threading
import time

from specdec.calls.request import ProposeCall
from draft_service.drafters.ngram import NgramDrafter
from draft_service.engine import INLINE_APPEND, DraftEngine
from draft_service.servicer import DraftServicer
from protos import specdec_pb2 as pb
from specdec.serving.engine_host import EngineHost

PROMPT = [7, 1, 2, 3, 4, 5, 6] * 50  # 350 tokens: past INLINE_APPEND, so indexed on the worker
assert len(PROMPT) > INLINE_APPEND


def spied_servicer():
    servicer = DraftServicer()
    servicer.host.attach(DraftEngine(NgramDrafter()), pb.ModelInfo(model="ngram", drafter="ngram"))
    threads: list[threading.Thread] = []
    propose = servicer.engine.propose

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return propose(*args, **kwargs)

    servicer.engine.propose = spy
    return servicer, threads


async def ask(servicer, known: int, append: list[int], max_tokens: int = 4) -> list[int]:
    request = pb.ProposeRequest(sequence_id="s", known_len=known, append_tokens=append, max_tokens=max_tokens)
    return [m.token_id async for m in servicer._propose(request, [])]


def reference(steps: list[tuple[int, list[int]]]) -> list[list[int]]:
    engine = DraftEngine(NgramDrafter())
    return [[p.token for p in engine.propose(ProposeCall("s", known, append, 4))] for known, append in steps]


def test_short_ngram_catch_up_runs_on_the_loop_a_prompt_on_the_worker():
    async def main():
        servicer, threads = spied_servicer()
        here = threading.current_thread()
        first = await ask(servicer, 0, PROMPT)
        assert threads[-1] is not here  # the prompt's index is built on the worker
        second = await ask(servicer, len(PROMPT) + 1, [first[0], 9])  # one accepted + the target's token
        assert threads[-1] is here
        assert [first, second] == reference([(0, PROMPT), (len(PROMPT) + 1, [first[0], 9])])

    asyncio.run(main())


def test_a_busy_worker_gets_the_call_after_its_work():
    async def main():
        servicer, threads = spied_servicer()
        await ask(servicer, 0, PROMPT)
        gate = threading.Event()
        blocker = asyncio.ensure_future(servicer.host.run(gate.wait))
        await asyncio.sleep(0.05)
        call = asyncio.ensure_future(ask(servicer, len(PROMPT), [7]))
        await asyncio.sleep(0.05)
        assert not call.done()  # queued behind the worker's call, not answered beside it
        gate.set()
        await blocker
        tokens = await call
        assert threads[-1] is not threading.current_thread()
        assert tokens == reference([(0, PROMPT), (len(PROMPT), [7])])[1] == [1, 2, 3, 4]

    asyncio.run(main())


def test_host_stays_busy_until_a_cancelled_callers_work_has_finished():
    """The caller that stops waiting does not stop the worker: the engine is not the loop's yet."""

    async def main():
        host = EngineHost("draft")
        assert host.idle
        gate = threading.Event()
        waiting = asyncio.ensure_future(host.run(gate.wait))
        await asyncio.sleep(0.05)
        assert not host.idle
        waiting.cancel()
        await asyncio.sleep(0.05)
        assert waiting.cancelled() and not host.idle
        gate.set()
        deadline = time.monotonic() + 10
        while not host.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert host.idle
        host.executor.shutdown()

    asyncio.run(main())
