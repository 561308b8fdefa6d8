"""Calls that join a running pass: the target's rows decoding ahead take, between two forwards, the
calls that arrived meanwhile (specdec/serving/batcher.py, Joins; target_service/decode_ahead.py,
`_joining`). Each joined call must get the tokens it would have got in a pass of its own (greedy:
the target's alone), and a call the pass cannot take must wait for the next one, never be lost."""

from __future__ import annotations

import asyncio
import time

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.calls.request import VerifyCall, VerifyResult
from specdec.errors import InvalidArgument
from specdec.maths.sampling import SamplingConfig
from specdec.model.cpu import gemm
from specdec.model.lm import CausalLM
from specdec.serving.batcher import Requeue
from target_service.batcher import VerifyBatcher
from target_service.engine import TargetEngine
from tests import tiny

GREEDY = SamplingConfig()
CHUNK = 16


@pytest.fixture(scope="module")
def compact():
    """A tiny Llama packed into compact weights, so that the one-call stack runs its passes and a
    short prompt can ride in the rows' forward (each engine packs its own copy)."""
    torch.manual_seed(11)
    return LlamaForCausalLM(tiny.tiny_config(hidden=256)).eval()


def engine(model) -> TargetEngine:
    model = copy.deepcopy(model)
    gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, "int8-a8")
    return TargetEngine(CausalLM(model, torch.device("cpu")), max_sequences=16, max_prefill_tokens=CHUNK)


def alone(model, prompt: list[int], tokens: int) -> list[int]:
    """The tokens the target makes for `prompt` decoding alone: the reference a joined call must match."""
    result = engine(model).verify(VerifyCall("alone", 0, prompt, [], [], GREEDY, decode_ahead=tokens - 1))
    return [result.next_token, *result.decoded]


class OfferOnce:
    """A Joins that offers its calls at the first forward's boundary, and records the answers."""

    def __init__(self, calls: list[VerifyCall]):
        self.calls, self.answers, self.asked = calls, {}, []

    def take(self, rows: int):
        self.asked.append(rows)
        offered, self.calls = self.calls, []
        return [(call, lambda result, sid=call.sequence_id: self.answers.__setitem__(sid, result)) for call in offered]


def clean(model, n: int, seed: int, tokens: int) -> list[list[int]]:
    """Prompts (at most a chunk long) whose continuation has no end of sequence within `tokens`."""
    prompts = [p[:CHUNK] for p in tiny.prompts(40, seed=seed)]
    return [p for p in prompts if tiny.EOS not in alone(model, p, tokens)][:n]


def test_calls_join_the_rows_decoding_ahead_and_get_their_own_tokens(compact):
    target = engine(compact)
    assert target.ragged
    first, second, held, fresh = clean(compact, 4, 23, 16)
    lead = target.verify(VerifyCall("held", 0, held, [], [], GREEDY))  # a sequence the target holds, not in the pass
    offer = OfferOnce([
        VerifyCall("held", lead.cached_len, [lead.next_token], [], [], GREEDY, decode_ahead=5),  # a step
        VerifyCall("fresh", 0, fresh, [], [], GREEDY, decode_ahead=3),  # a new sequence's prompt
        VerifyCall("a", 0, first, [], [], GREEDY, decode_ahead=2),  # a sequence already in the pass: the next one
        VerifyCall("bad", 0, [10 ** 6], [], [], GREEDY, decode_ahead=2),  # a token past the vocabulary: its error
    ])
    settled = []
    results = target.verify_batch([VerifyCall("a", 0, first, [], [], GREEDY, decode_ahead=8),
                                   VerifyCall("b", 0, second, [], [], GREEDY, decode_ahead=8)],
                                  settle=lambda index, result: settled.append(index), join=offer)
    for prompt, result in zip((first, second), results):
        got = [result.next_token, *result.decoded]
        assert got == alone(compact, prompt, 9)
    step, new = offer.answers["held"], offer.answers["fresh"]
    assert isinstance(step, VerifyResult) and isinstance(new, VerifyResult)
    assert [lead.next_token, step.next_token, *step.decoded] == alone(compact, held, 7)
    assert [new.next_token, *new.decoded] == alone(compact, fresh, 4)
    assert step.ahead_passes == 5 and new.ahead_passes == 3  # their own budgets, decoded with the rows
    assert isinstance(offer.answers["a"], Requeue) and offer.answers["a"].call.sequence_id == "a"
    assert isinstance(offer.answers["bad"], InvalidArgument)
    assert offer.asked[0] == 2  # offered room beside the pass's two rows


def test_a_pass_interrupted_for_a_call_it_cannot_take_hands_its_joiners_back(compact):
    target = engine(compact)
    first, second, fresh = clean(compact, 3, 29, 8)
    offer = OfferOnce([VerifyCall("fresh", 0, fresh, [], [], GREEDY, decode_ahead=3)])
    results = target.verify_batch([VerifyCall("a", 0, first, [], [], GREEDY, decode_ahead=6),
                                   VerifyCall("b", 0, second, [], [], GREEDY, decode_ahead=6)],
                                  interrupt=lambda: True, settle=lambda index, result: None, join=offer)
    assert all(isinstance(r, VerifyResult) and not r.decoded for r in results)  # stopped before its first pass ahead
    assert isinstance(offer.answers["fresh"], Requeue)  # not lost: back to the batcher's queue


def test_a_call_submitted_during_a_pass_joins_it_through_the_batcher(compact):
    """Through the target's batcher: a call that arrives while two rows decode ahead is answered from
    within their pass (no pass of its own), with the tokens the target makes alone."""
    target = engine(compact)
    first, second, late = clean(compact, 3, 37, 24)
    passes: list[int] = []

    def verify_batch(calls, alone, settle=None, join=None):
        passes.append(len(calls))
        slow = join is not None and len(calls) == 2

        class Slow:  # each forward of the two rows takes a while: the late call arrives during the pass
            def take(self, rows):
                if slow:
                    loop.call_soon_threadsafe(running.set)
                    time.sleep(0.02)
                return join.take(rows)

        return target.verify_batch(calls, alone, settle=settle, join=Slow() if join is not None else None)

    async def main():
        nonlocal loop, running
        loop, running = asyncio.get_running_loop(), asyncio.Event()
        batcher = VerifyBatcher(lambda fn, *args: loop.run_in_executor(None, fn, *args), verify_batch, window_s=0.05,
                                settles=True, joinable=lambda call: True)
        rows = [batcher.submit(VerifyCall(sid, 0, p, [], [], GREEDY, decode_ahead=20)) for sid, p in (("a", first), ("b", second))]
        tasks = [asyncio.ensure_future(r) for r in rows]
        await running.wait()  # the two rows' pass is decoding ahead: 20 forwards, 20 ms each at least
        joined = await batcher.submit(VerifyCall("late", 0, late, [], [], GREEDY, decode_ahead=3))
        done = await asyncio.gather(*tasks)
        batcher.close()
        return joined, done

    loop = running = None
    joined, done = asyncio.run(main())
    assert [joined.next_token, *joined.decoded] == alone(compact, late, 4)
    for prompt, result in zip((first, second), done):
        assert [result.next_token, *result.decoded] == alone(compact, prompt, 21)
    assert passes == [2]  # the late call had no pass of its own
