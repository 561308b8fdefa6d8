"""A prompt chunk rides in the decoding rows' forward (TargetEngine._fuses) where the compact stack runs
the pass: no forward of its own, the same cache bits and the same tokens as a chunk fed apart, and
the batcher puts such a chunk into the rows' pass instead of a pass of its own."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.kv.buffers import arena_of
from specdec.model.cpu import gemm, stack
from specdec.model.lm import CausalLM
from specdec.serving.batcher import ContinuousBatcher, Requeue
from specdec.calls.request import VerifyCall, VerifyResult
from specdec.maths.sampling import SamplingConfig
from target_service import engine as engine_module
from target_service.batcher import VerifyBatcher
from target_service.engine import TargetEngine
from tests import tiny

CPU = torch.device("cpu")
GREEDY = SamplingConfig()
pytestmark = pytest.mark.skipif(not gemm.available(CPU, torch.float32), reason="no C compiler to build the kernel")
CHUNK = 16


@pytest.fixture(scope="module")
def compact():
    """A tiny Llama (heads of 64, as SmolLM2's) to pack into compact weights, whose passes the one-call
    stack runs; each engine packs its own copy (a packed model does not deep-copy)."""
    torch.manual_seed(7)
    return LlamaForCausalLM(tiny.tiny_config(hidden=256)).eval()


def _packed_engine(model) -> TargetEngine:
    model = copy.deepcopy(model)
    gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, "int8-a8")
    return TargetEngine(CausalLM(model, CPU), max_sequences=16, max_prefill_tokens=CHUNK)


def _engine(model) -> TargetEngine:
    eng = _packed_engine(model)
    eng._chunk_budget = lambda alone: CHUNK  # chunk boundaries fixed, whatever the costs measured
    return eng


def _keys(eng: TargetEngine, name: str, length: int) -> torch.Tensor:
    seq = eng.store._sequences[name]
    arena = arena_of(seq.cache)
    if arena is not None:
        return arena[..., :length, :].clone()
    return torch.stack([torch.cat([layer.keys[..., :length, :], layer.values[..., :length, :]]) for layer in seq.cache.layers])


def _run(eng: TargetEngine, long_prompt: list[int], short: list[list[int]], steps: int) -> dict[str, list[int]]:
    """Short sequences decoding while a long prompt is fed CHUNK tokens a pass, every call in one verify_batch."""
    out = {f"s{i}": [] for i in range(len(short))}
    out["long"] = []
    state = {f"s{i}": (0, list(p)) for i, p in enumerate(short)}
    state["long"] = (0, list(long_prompt))
    pending_long: VerifyCall | None = VerifyCall("long", 0, list(long_prompt), [], [], GREEDY)
    for name in [n for n in state if n != "long"]:  # the short prompts first, so they decode
        result = eng.verify(VerifyCall(name, 0, state[name][1], [], [], GREEDY))
        out[name].append(result.next_token)
        state[name] = (result.cached_len, [result.next_token])
    for _ in range(steps):
        names = [n for n in state if n != "long"]
        calls = [VerifyCall(n, state[n][0], state[n][1], [], [], GREEDY) for n in names]
        if pending_long is not None:
            calls.append(pending_long)
            names.append("long")
        results = eng.verify_batch(calls, decode_ahead=False)
        for name, result in zip(names, results):
            if isinstance(result, Requeue):
                pending_long = result.call
                continue
            assert isinstance(result, VerifyResult), result
            out[name].append(result.next_token)
            state[name] = (result.cached_len, [result.next_token])
            if name == "long":
                pending_long = VerifyCall("long", result.cached_len, [result.next_token], [], [], GREEDY)
    return out


def test_a_chunk_beside_decoding_rows_rides_in_their_forward(compact, monkeypatch):
    """No forward of its own (feed is not called) and the stack runs every pass, chunk included."""
    fused = _engine(compact)
    assert fused.ragged and stack.applies(fused.lm)
    monkeypatch.setattr(engine_module, "feed", lambda *a, **k: pytest.fail("a chunk took a forward of its own"))
    passes = []
    real = stack.forward_rows
    monkeypatch.setattr(stack, "forward_rows", lambda lm, seqs, pending, keeps: passes.append([len(p) for p in pending])
                        or real(lm, seqs, pending, keeps))
    long_prompt = (tiny.prompts(1, seed=31)[0] * 40)[:100]
    _run(fused, long_prompt, [p[:6] for p in tiny.prompts(3, seed=32)], 8)
    chunked = [rows for rows in passes if CHUNK in rows]
    assert len(chunked) >= 5 and all(len(rows) == 4 for rows in chunked), passes  # 3 decode rows + the chunk


def test_fused_chunks_give_the_bits_and_tokens_of_chunks_fed_apart(compact, monkeypatch):
    """The same passes with the chunk in a forward of its own (_fuses off): every cached key and value
    of the long prompt equal, and every sequence's tokens too; and the long prompt's tokens are those
    of the target decoding it alone."""
    long_prompt = (tiny.prompts(1, seed=33)[0] * 40)[:90]
    short = [p[:6] for p in tiny.prompts(4, seed=34)]
    fused = _engine(compact)
    got = _run(fused, long_prompt, short, 14)
    apart = _engine(compact)
    apart._fuses = lambda calls, groups: False
    want = _run(apart, long_prompt, short, 14)
    assert got == want and len(got["long"]) >= 6
    assert torch.equal(_keys(fused, "long", len(long_prompt)), _keys(apart, "long", len(long_prompt)))
    alone = _engine(compact)
    tokens, known = list(long_prompt), 0
    for _ in range(len(got["long"])):
        result = alone.verify(VerifyCall("x", known, tokens[known:], [], [], GREEDY))
        tokens.append(result.next_token)
        known = result.cached_len
    assert got["long"] == tokens[len(long_prompt):]


def test_a_ragged_batcher_counts_positions_not_padding():
    """Three one-token rows and a 20-token chunk: padded, 4 x 20 > 32 and the chunk waits; ragged, 23 <= 32."""
    async def main(ragged: bool) -> list[list[int]]:
        passes: list[list[int]] = []

        def run_batch(calls, alone):
            passes.append(list(calls))
            return list(calls)

        loop = asyncio.get_running_loop()
        batcher = ContinuousBatcher(lambda fn, *a: loop.run_in_executor(None, fn, *a), run_batch, key=lambda c: c, cost=lambda c: c,
                                    window_s=0.05, max_batch_size=8, max_batch_tokens=32, ragged=lambda: ragged)
        await asyncio.gather(*(batcher.submit(c) for c in (1.0, 1.1, 1.2, 20)))
        batcher.close()
        return passes

    assert [len(p) for p in asyncio.run(main(True))] == [4]
    assert [len(p) for p in asyncio.run(main(False))] == [3, 1]


def test_the_verify_batcher_prices_a_long_prompt_at_one_chunk(compact):
    eng = _engine(compact)
    batcher = VerifyBatcher(None, eng.verify_batch, engine=lambda: eng)
    call = VerifyCall("long", 0, list(range(3, 200)), [], [], GREEDY)
    assert batcher._cost(call) == CHUNK and batcher._ragged()
    assert batcher._cost(VerifyCall("s", 0, [5, 6, 7], [1, 2], [], GREEDY)) == 5
    # a step's draft is verified whole, however short the chunks: priced at all its positions
    assert batcher._cost(VerifyCall("d", 3, [8], list(range(20, 40)), [], GREEDY)) == 21


def test_a_row_decoding_in_the_same_pass_keeps_the_chunk_short(compact):
    """A decoding row of this very pass holds its new token when the chunk is sized: it still decodes,
    so the prompt beside it gets an ordinary chunk, not the 8x one for a server where nobody decodes
    (which, riding in the row's forward, made that step seconds long)."""
    eng = _packed_engine(compact)
    first = eng.verify(VerifyCall("other", 0, tiny.prompts(1, seed=35)[0][:6], [], [], GREEDY))
    long_prompt = (tiny.prompts(1, seed=36)[0] * 40)[:150]
    results = eng.verify_batch([VerifyCall("other", first.cached_len, [first.next_token], [], [], GREEDY),
                                VerifyCall("long", 0, long_prompt, [], [], GREEDY)], decode_ahead=True)
    assert isinstance(results[0], VerifyResult) and isinstance(results[1], Requeue)
    assert eng.store._sequences["long"].cached == CHUNK
