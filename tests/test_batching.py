"""Batched verification gives exactly the tokens unbatched verification gives (specdec/forward/batching.py).

Rows of mixed prompt lengths and draft lengths, sequences joining and leaving between steps,
rollback rows, rows whose sequence was lost (NOT_FOUND) next to healthy ones, and the sampling path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import random
import threading
import time

import pytest
import torch

from specdec.forward import batching
from specdec.errors import InvalidArgument, SequenceNotFound
from specdec.kv.buffers import MIN_CAPACITY, arena_of
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from specdec.serving.batcher import Requeue
from target_service.batcher import VerifyBatcher
from specdec.calls.request import VerifyCall, VerifyResult
from target_service.engine import TargetEngine
from tests.tiny import EOS, prompts, reference_greedy, tiny_pair

GREEDY = SamplingConfig()
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    return tiny_pair()[0]


@pytest.fixture(autouse=True, params=["arena", "per-layer"])
def layout(request, monkeypatch):
    """Every test runs on both ways of building a batch: each row's cache from its sequence's arena
    with one copy (all layers of these models have one shape), and layer by layer (models whose
    layers differ in shape)."""
    if request.param == "per-layer":
        monkeypatch.setattr(batching, "arena_shape", lambda cache: None)
    return request.param


def engine(model) -> TargetEngine:
    return TargetEngine(CausalLM(model, torch.device("cpu")), max_sequences=64)


class Decoder:
    """One sequence decoded by speculation, with drafts that copy the reference continuation and
    are corrupted at random, so every step mixes acceptance, rejection, bonus and draft length 0."""

    def __init__(self, name: str, prompt: list[int], reference: list[int], rng: random.Random):
        self.name, self.prompt, self.reference, self.rng = name, prompt, reference, rng
        self.tokens = list(prompt)  # canonical: prompt + generated
        self.known = 0  # tokens the target holds of self.tokens

    @property
    def done(self) -> bool:
        generated = self.tokens[len(self.prompt):]
        return len(generated) >= len(self.reference) or (bool(generated) and generated[-1] == EOS)

    def call(self, sampling: SamplingConfig = GREEDY) -> VerifyCall:
        at = len(self.tokens) - len(self.prompt)
        gamma = self.rng.choice([0, 1, 3, 5, 8])
        draft = list(self.reference[at:at + gamma])
        if draft and self.rng.random() < 0.5:
            draft[self.rng.randrange(len(draft))] = self.rng.randrange(256)  # a wrong guess somewhere
        return VerifyCall(self.name, self.known, self.tokens[self.known:], draft, [], sampling)

    def apply(self, call: VerifyCall, result: VerifyResult) -> None:
        self.tokens += call.draft_tokens[:result.accepted] + [result.next_token]
        self.known = result.cached_len


def test_batched_greedy_equals_unbatched_and_the_target_alone(target):
    """Sequences join and leave at every step; every step's batched verdict equals the unbatched one."""
    rng = random.Random(0)
    batched, single = engine(target), engine(target)
    pool = prompts(10, seed=3)
    refs = [reference_greedy(target, p, NEW_TOKENS) for p in pool]
    decoders = [Decoder(f"s{i}", p, r, random.Random(i)) for i, (p, r) in enumerate(zip(pool, refs))]
    active: list[Decoder] = []
    waiting = list(decoders)
    sizes = []
    while waiting or active:
        while waiting and (not active or rng.random() < 0.4):  # join at any step
            active.append(waiting.pop(0))
        step = [d for d in active if rng.random() < 0.85] or active[:1]  # some sit a step out
        calls = [d.call() for d in step]
        results = batched.verify_batch(calls)
        for d, call, result in zip(step, calls, results):
            alone = single.verify(VerifyCall(call.sequence_id, call.known_len, call.append, call.draft_tokens, [], GREEDY))
            assert (result.accepted, result.next_token, result.cached_len) == (alone.accepted, alone.next_token, alone.cached_len)
            d.apply(call, result)
        sizes.append(len(step))
        for d in [d for d in active if d.done]:  # leave at any step
            active.remove(d)
            batched.release(d.name)
    for d in decoders:
        assert d.tokens[len(d.prompt):][:len(d.reference)] == d.reference, d.name
    assert max(sizes) >= 4 and len(batched.store) == 0


def test_sequences_outgrow_their_caches_batched_and_alone(target, layout):
    """Long sequences that alternate between batched steps and steps alone: their caches grow in
    both (the arena in a batched write-back, a layer's own buffer in a forward alone, which moves the
    sequence out of its arena until the next batch copies it back in) and the tokens stay the target's."""
    batched = engine(target)
    pool = [p * 3 for p in prompts(3, seed=13)]
    refs = [reference_greedy(target, p, 100) for p in pool]
    decoders = [Decoder(f"g{i}", p, r, random.Random(10 + i)) for i, (p, r) in enumerate(zip(pool, refs))]
    for step in range(200):
        active = [d for d in decoders if not d.done]
        if not active:
            break
        group = active if step % 3 else active[step % len(active):][:1]  # every third step one row alone
        calls = [d.call() for d in group]
        for d, call, result in zip(group, calls, batched.verify_batch(calls)):
            d.apply(call, result)
        if layout == "arena" and len(group) > 1:
            arenas = [arena_of(batched.store._sequences[d.name].cache) for d in group]
            assert all(a is not None for a in arenas)  # a batched write-back leaves every row in an arena
    for d in decoders:
        assert d.tokens[len(d.prompt):][:len(d.reference)] == d.reference, d.name
    if layout == "arena":
        assert max(arena_of(batched.store._sequences[d.name].cache).shape[-2] for d in decoders) > 2 * MIN_CAPACITY


def test_rows_fail_alone_and_rollback_rows_match(target):
    """A lost sequence (NOT_FOUND) and a bad field fail their own rows only; a row that rolls back
    (known_len below what the target holds, as after a draft failure) gets the unbatched verdict."""
    batched, single = engine(target), engine(target)
    p = prompts(3, seed=5)
    for eng in (batched, single):
        for i in range(2):
            eng.verify(VerifyCall(f"r{i}", 0, p[i], [1, 2, 3], [], GREEDY))  # hold prompt + accepted drafts
    calls = [
        VerifyCall("r0", len(p[0]) - 2, p[0][-2:], [7, 8], [], GREEDY),  # roll back two tokens, re-send them
        VerifyCall("lost", 5, [1], [2], [], GREEDY),
        VerifyCall("r1", len(p[1]), [9], [4, 5, 6], [], GREEDY),
        VerifyCall("bad", 0, [1, 2], [10**6], [], GREEDY),
        VerifyCall("new", 0, p[2], [], [], GREEDY),
    ]
    results = batched.verify_batch(calls)
    assert isinstance(results[1], SequenceNotFound) and isinstance(results[3], InvalidArgument)
    assert results[3].field == "draft_tokens"
    for index in (0, 2, 4):
        call = calls[index]
        alone = single.verify(VerifyCall(call.sequence_id, call.known_len, call.append, call.draft_tokens, [], GREEDY))
        assert results[index] == VerifyResult(alone.accepted, alone.next_token, alone.cached_len, results[index].compute_seconds,
                                               batch_size=3)


def test_batched_sampling_equals_unbatched(target):
    """Rejection sampling per row with its own seeded uniforms: same tokens in any batch."""
    batched, single = engine(target), engine(target)
    pool = prompts(6, seed=7)
    rng = random.Random(1)
    decoders = [Decoder(f"q{i}", p, reference_greedy(target, p, 12), random.Random(10 + i)) for i, p in enumerate(pool)]
    for _ in range(6):
        step = [d for d in decoders if not d.done and rng.random() < 0.9]
        if not step:
            break
        calls = []
        for i, d in enumerate(step):
            sampling = SamplingConfig(temperature=0.8 + 0.1 * i, top_k=[0, 20][i % 2], top_p=[1.0, 0.9][i % 2], seed=100 + i)
            base = d.call(sampling)
            dists = [([t, (t + 1) % 256], [0.7, 0.3]) for t in base.draft_tokens]  # a p the draft "drew" from
            calls.append(VerifyCall(base.sequence_id, base.known_len, base.append, base.draft_tokens, dists, sampling))
        results = batched.verify_batch(calls)
        for d, call, result in zip(step, calls, results):
            alone = single.verify(call)
            assert (result.accepted, result.next_token, result.cached_len) == (alone.accepted, alone.next_token, alone.cached_len)
            d.apply(call, result)


def test_batcher_groups_concurrent_calls_and_keeps_rows_apart(target):
    """Calls that wait together share one pass; a second call for a sequence already in the batch
    waits for the next; a call cancelled while waiting is skipped."""
    eng = engine(target)
    p = prompts(5, seed=9)

    async def main():
        loop = asyncio.get_running_loop()
        run = lambda fn, *args: loop.run_in_executor(None, fn, *args)  # noqa: E731
        batcher = VerifyBatcher(run, eng.verify_batch, window_s=0.05, max_batch_size=3)
        calls = [VerifyCall(f"b{i}", 0, p[i], [1, 2], [], GREEDY) for i in range(4)]
        duplicate = VerifyCall("b0", 0, p[0], [3], [], GREEDY)
        tasks = [asyncio.ensure_future(batcher.submit(c)) for c in [*calls, duplicate]]
        doomed = asyncio.ensure_future(batcher.submit(VerifyCall("gone", 0, [1, 2], [], [], GREEDY)))
        await asyncio.sleep(0)
        doomed.cancel()
        results = await asyncio.gather(*tasks)
        batcher.close()
        return results

    results = asyncio.run(main())
    assert [r.batch_size for r in results[:3]] == [3, 3, 3]  # capped at max_batch_size
    assert results[3].batch_size == 2 and results[4].batch_size == 2  # the rest, and b0's second call
    assert "gone" not in eng.store


def test_batcher_keeps_long_prefills_out_of_decode_batches(target):
    """Rows are padded to the longest row: a long prefill runs alone instead of padding the others."""
    eng = engine(target)
    p = prompts(4, seed=11)
    long_prompt = (p[0] * 20)[:200]

    async def main():
        loop = asyncio.get_running_loop()
        run = lambda fn, *args: loop.run_in_executor(None, fn, *args)  # noqa: E731
        batcher = VerifyBatcher(run, eng.verify_batch, window_s=0.05, max_batch_size=8, max_batch_tokens=64)
        calls = [VerifyCall("long", 0, long_prompt, [1], [], GREEDY)] + [VerifyCall(f"d{i}", 0, p[i][:8], [1, 2], [], GREEDY) for i in range(1, 4)]
        results = await asyncio.gather(*(batcher.submit(c) for c in calls))
        batcher.close()
        return results

    results = asyncio.run(main())
    assert [r.batch_size for r in results] == [1, 3, 3, 3]


def test_batcher_merges_streams_that_come_back_at_different_times(target):
    """Eight streams, half of them slower to come back after each pass (a slower coordinator or
    draft): the batcher waits for every sequence active lately, so after the first passes all
    eight share each pass, instead of two half batches alternating for good."""
    eng = engine(target)
    p = prompts(8, seed=13)
    sizes: list[int] = []

    async def stream(batcher, i):
        known, append = 0, p[i][:6]
        await asyncio.sleep(0.003 * (i % 2))  # the first pass already sees them apart
        for _ in range(6):
            result = await batcher.submit(VerifyCall(f"m{i}", known, append, [], [], GREEDY))
            sizes.append(result.batch_size)
            known, append = known + len(append), [result.next_token]
            await asyncio.sleep(0.001 if i < 4 else 0.012)  # the slow half is back 11 ms later
        batcher.released(f"m{i}")

    async def main():
        loop = asyncio.get_running_loop()
        run = lambda fn, *args: loop.run_in_executor(None, fn, *args)  # noqa: E731
        # A window far past the 11 ms the slow half lags (it bounds the wait, and costs nothing once
        # all eight are in): at 30 ms a busy machine's stalls could split a pass.
        batcher = VerifyBatcher(run, eng.verify_batch, window_s=0.2, max_batch_size=8)
        await asyncio.gather(*(stream(batcher, i) for i in range(8)))
        batcher.close()

    asyncio.run(main())
    # The first pass holds the streams there at once, the last the ones a call behind; between
    # them every pass holds all eight.
    assert set(sizes[4:-4]) == {8}, sizes


def test_a_lone_sequence_runs_from_its_own_call_and_newcomers_wait_for_the_model(target):
    """The only active sequence, seen before, runs without the batcher's task (no hops to it and
    back); a sequence that calls meanwhile waits for the model, never runs beside it, and joins
    through the batch window."""
    eng, single = engine(target), engine(target)
    p = prompts(2, seed=17)
    in_flight, most = [0], [0]
    gate = threading.Event()

    def verify_batch(calls, decode_ahead=True):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        gate.wait(10)
        try:
            return eng.verify_batch(calls, decode_ahead)
        finally:
            in_flight[0] -= 1

    async def main():
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(4)  # more threads than the engine's one: overlap would show
        batcher = VerifyBatcher(lambda fn, *args: loop.run_in_executor(pool, fn, *args), verify_batch, window_s=0.01)
        direct = []
        run_alone = batcher._run_alone
        batcher._run_alone = lambda call: direct.append(call.sequence_id) or run_alone(call)
        gate.set()
        first = await batcher.submit(VerifyCall("a", 0, p[0], [], [], GREEDY))
        gate.clear()
        second = asyncio.ensure_future(batcher.submit(VerifyCall("a", first.cached_len, [first.next_token], [], [], GREEDY)))
        await asyncio.sleep(0.1)  # a's call has reached the model (the gate holds it there)
        newcomer = asyncio.ensure_future(batcher.submit(VerifyCall("b", 0, p[1], [], [], GREEDY)))
        await asyncio.sleep(0.1)
        assert not newcomer.done()
        gate.set()
        results = await asyncio.gather(second, newcomer)
        batcher.close()
        pool.shutdown()
        return first, results, direct

    first, (second, newcomer), direct = asyncio.run(main())
    assert direct == ["a"] and most[0] == 1  # a's first call met the window; its second ran directly
    expected = single.verify(VerifyCall("a", 0, p[0], [], [], GREEDY))
    assert (first.next_token, second.next_token) == (expected.next_token, single.verify(VerifyCall("a", expected.cached_len, [expected.next_token], [], [], GREEDY)).next_token)
    assert newcomer.next_token == single.verify(VerifyCall("b", 0, p[1], [], [], GREEDY)).next_token


# -- chunked prefill (TargetEngine max_prefill_tokens, batcher Requeue) ---------------------------------

def decode(eng: TargetEngine, name: str, prompt: list[int], n: int) -> list[int]:
    tokens, known = list(prompt), 0
    for _ in range(n):
        result = eng.verify(VerifyCall(name, known, tokens[known:], [], [], GREEDY))
        tokens.append(result.next_token)
        known = result.cached_len
    return tokens[len(prompt):]


def test_a_prompt_fed_in_chunks_decodes_as_one_fed_whole(target):
    long_prompt = (prompts(1, seed=21)[0] * 30)[:150]
    chunked = TargetEngine(CausalLM(target, torch.device("cpu")), max_sequences=8, max_prefill_tokens=16)
    decode(chunked, "other", prompts(1, seed=24)[0][:6], 1)  # another sequence decodes: a chunk of 16
    first = chunked.verify_batch([VerifyCall("c", 0, long_prompt, [], [], GREEDY)], decode_ahead=False)[0]
    assert isinstance(first, Requeue) and first.call.prefill == 150 - 16 and first.call.known_len == 150
    assert chunked.store._sequences["c"].cached == 16
    chunked.release("other")  # nobody decodes: the long prompt feeds 8 times as much
    second = chunked.verify_batch([first.call])[0]
    assert isinstance(second, Requeue) and chunked.store._sequences["c"].cached == 16 + 128
    assert decode(chunked, "x", long_prompt, 12) == decode(engine(target), "x", long_prompt, 12)


def test_a_sequence_alone_in_its_pass_but_not_on_the_server_feeds_ordinary_chunks(target):
    """Another sequence that is drafting its next step is not in this pass, yet the long chunk a
    lone sequence may feed would hold its next step up: the 8x chunk is for a server with one sequence."""
    eng = TargetEngine(CausalLM(target, torch.device("cpu")), max_sequences=8, max_prefill_tokens=16)
    decode(eng, "other", prompts(1, seed=24)[0][:6], 1)  # held by the store, between its steps
    long_prompt = (prompts(1, seed=21)[0] * 30)[:150]
    first = eng.verify_batch([VerifyCall("c", 0, long_prompt, [], [], GREEDY)], decode_ahead=True)[0]
    assert isinstance(first, Requeue) and eng.store._sequences["c"].cached == 16


def test_other_sequences_step_between_the_chunks_of_a_long_prompt(target):
    """With a 200-token prompt in flight, fed 16 tokens a pass, three short sequences decode 8 tokens
    each: every one of their steps runs before the long prompt's next chunk, so they finish first,
    and the long prompt's tokens are those of a prompt fed whole."""
    eng = TargetEngine(CausalLM(target, torch.device("cpu")), max_sequences=16, max_prefill_tokens=16)
    long_prompt = (prompts(1, seed=22)[0] * 40)[:200]
    finished: list[str] = []

    async def stream(batcher, name: str, prompt: list[int], steps: int) -> list[int]:
        known, append, out = 0, list(prompt), []
        for _ in range(steps):
            result = await batcher.submit(VerifyCall(name, known, append, [], [], GREEDY))
            out.append(result.next_token)
            known, append = result.cached_len, [result.next_token]
        finished.append(name)
        return out

    async def main():
        loop = asyncio.get_running_loop()
        run = lambda fn, *args: loop.run_in_executor(None, fn, *args)  # noqa: E731
        batcher = VerifyBatcher(run, eng.verify_batch, window_s=0.01, max_batch_size=8, max_batch_tokens=64)
        short = [stream(batcher, f"s{i}", prompts(3, seed=23)[i][:6], 8) for i in range(3)]
        results = await asyncio.gather(stream(batcher, "long", long_prompt, 2), *short)
        batcher.close()
        return results

    results = asyncio.run(main())
    assert finished[-1] == "long"
    assert results[0] == decode(engine(target), "alone", long_prompt, 2)


def test_only_sequences_that_decode_lately_keep_a_lone_prompts_chunks_short(target):
    """A long prompt's chunks grow 8x when nobody else decodes: a sequence still being fed does not
    count, nor one idle past the batcher's horizon (a paused client). Counting those made 120 prompts
    beside one idle sequence feed each other 2-token chunks (tests/test_shutdown.py's drain)."""
    eng = TargetEngine(CausalLM(target, torch.device("cpu")), max_sequences=8, max_prefill_tokens=16)
    long_prompt = (prompts(1, seed=21)[0] * 60)[:400]
    waiting = eng.verify_batch([VerifyCall("w", 0, long_prompt[:40], [], [], GREEDY)], decode_ahead=False)[0]
    assert isinstance(waiting, Requeue)  # "w" holds 24 tokens not fed yet
    first = eng.verify_batch([VerifyCall("c", 0, long_prompt, [], [], GREEDY)])[0]
    assert isinstance(first, Requeue) and eng.store._sequences["c"].cached == 128  # "w" does not decode
    decode(eng, "other", prompts(1, seed=24)[0][:6], 1)
    second = eng.verify_batch([first.call])[0]
    fed = eng.store._sequences["c"].cached
    assert isinstance(second, Requeue) and 128 < fed <= 128 + 16  # "other" decodes: a chunk within the bound
    eng.store._sequences["other"].last_used -= 60  # ... but not for a minute
    eng.verify_batch([second.call])
    assert eng.store._sequences["c"].cached == fed + 128


def test_chunks_beside_decoding_rows_grow_with_the_prompts_waiting_per_decoding_sequence(target):
    """A chunk beside decoding rows takes CHUNK_STEPS of their step per prompt being fed per decoding
    sequence (at least one): six prompts waiting behind one decoding sequence no longer crawl in
    chunks sized to that one row's step, while one prompt beside six decoding rows keeps the plain
    bound (the victims' shape). Costs are set by hand so the sizes do not depend on this machine."""
    long_prompt = (prompts(1, seed=21)[0] * 60)[:300]

    def fed_beside(decoding: int, waiting: int) -> int:
        eng = TargetEngine(CausalLM(target, torch.device("cpu")), max_sequences=16, max_prefill_tokens=64)
        for i in range(decoding):
            decode(eng, f"d{i}", prompts(1, seed=30 + i)[0][:6], 1)
        for i in range(waiting - 1):  # prompts already being fed, their first chunk in
            assert isinstance(eng.verify_batch([VerifyCall(f"w{i}", 0, long_prompt, [], [], GREEDY)], decode_ahead=False)[0], Requeue)
        eng._step_s, eng._prefill_token_s = 0.008, 0.001  # a step costs 8 prompt tokens: a plain chunk is 6
        for seq in eng.store:  # all of them called lately, however slowly this machine fed them
            seq.last_used = time.monotonic()
        assert isinstance(eng.verify_batch([VerifyCall("c", 0, long_prompt, [], [], GREEDY)], decode_ahead=False)[0], Requeue)
        return eng.store._sequences["c"].cached

    assert fed_beside(decoding=6, waiting=1) == 6
    assert fed_beside(decoding=1, waiting=1) == 6
    assert 30 <= fed_beside(decoding=1, waiting=6) <= 36  # 6 prompts a decoding sequence: 6 x 6
    assert fed_beside(decoding=1, waiting=12) == 64  # within --max-prefill-tokens-per-pass all the same


# -- passes split by cache length (batching.pad_groups) --------------------------------------------------

def test_pad_groups_keeps_like_lengths_together_and_a_long_cache_apart():
    assert batching.pad_groups([60, 4000, 100, 3990, 80]) == [[0, 4, 2], [3, 1]]
    assert batching.pad_groups([10, 20, 30], budget=30) == [[0, 1, 2]]  # padding 3 x 30 - 60 = 30
    assert batching.pad_groups([10, 20, 30], budget=29) == [[0, 1], [2]]
    assert batching.pad_groups([]) == [] and batching.pad_groups([5]) == [[0]]


def test_rows_of_unlike_cache_lengths_verify_in_passes_of_their_own(target, monkeypatch):
    """A row whose cache is far longer than the others' would make every row pay for its keys in
    padding: it gets a pass of its own, and every row's verdict is the one it gets alone."""
    import target_service.engine as target_engine

    passes: list[int] = []
    real = target_engine.forward_batch

    def counted(lm, seqs, *args, **kwargs):
        passes.append(len(seqs))
        return real(lm, seqs, *args, **kwargs)

    monkeypatch.setattr(target_engine, "forward_batch", counted)
    split = batching.pad_groups
    monkeypatch.setattr(batching, "pad_groups", lambda cached: split(cached, budget=64))
    batched, single = engine(target), engine(target)
    pool = [p[:6] for p in prompts(3, seed=31)] + [(prompts(1, seed=32)[0] * 20)[:120]]
    for eng in (batched, single):
        for i, p in enumerate(pool):
            eng.verify(VerifyCall(f"s{i}", 0, p, [], [], GREEDY))
    calls = [VerifyCall(f"s{i}", len(p), [], [3, 5], [], GREEDY) for i, p in enumerate(pool)]
    results = batched.verify_batch(calls, decode_ahead=False)
    assert passes == [3]  # the three short rows together; the long one alone, without forward_batch
    for call, result in zip(calls, results):
        alone = single.verify(call)
        assert (result.accepted, result.next_token, result.cached_len) == (alone.accepted, alone.next_token, alone.cached_len)


def test_long_prompts_that_are_all_being_fed_take_long_chunks(target):
    """Two long prompts and nobody decoding (nor, says the batcher, waiting to): a long chunk delays
    nobody's tokens, so each pass feeds 8 times the per-pass bound; once a sequence decodes, chunks
    shrink to the bound again."""
    eng = TargetEngine(CausalLM(target, torch.device("cpu")), max_sequences=8, max_prefill_tokens=16)
    a, b = (prompts(1, seed=25)[0] * 40)[:300], (prompts(1, seed=26)[0] * 40)[:300]
    first = eng.verify_batch([VerifyCall("a", 0, a, [], [], GREEDY), VerifyCall("b", 0, b, [], [], GREEDY)])
    assert all(isinstance(r, Requeue) for r in first)
    assert (eng.store._sequences["a"].cached, eng.store._sequences["b"].cached) == (128, 0)  # one row a pass
    decode(eng, "short", prompts(1, seed=27)[0][:6], 1)
    eng.verify_batch([first[1].call])
    assert eng.store._sequences["b"].cached == 16


def test_the_batcher_counts_long_prompts_being_fed_as_nobody_waiting():
    """The batcher's `alone`: no other active sequence would wait on this pass's extra work, those
    whose last pass fed a chunk aside (a long prompt being fed has no tokens to wait for)."""
    seen: list[tuple[str, bool]] = []

    def run_batch(calls, alone):
        seen.append((calls[0].sequence_id, alone))
        return [Requeue(dataclasses.replace(call, prefill=0)) if call.prefill else VerifyResult(0, 1, 1, 0.0, batch_size=len(calls))
                for call in calls]

    async def main():
        loop = asyncio.get_running_loop()
        run = lambda fn, *args: loop.run_in_executor(None, fn, *args)  # noqa: E731
        batcher = VerifyBatcher(run, run_batch, window_s=0.05, max_batch_size=1)
        await asyncio.gather(batcher.submit(VerifyCall("a", 0, [1], [], [], GREEDY, prefill=1)),
                             batcher.submit(VerifyCall("b", 0, [1], [], [], GREEDY)))
        batcher.close()

    asyncio.run(main())
    # a's chunk: b waits behind it; b's step: a is being fed, nobody waits; a's last pass: b is active
    assert seen == [("a", False), ("b", True), ("a", False)]


def test_a_lone_step_runs_on_the_event_loop_where_the_servicer_allows_it():
    """`inline`: a lone sequence's step may run right on the event loop (no hop to the worker and
    back); its first call still goes through the window to the worker, and a call `inline` refuses
    (here: a long catch-up, as a prompt re-sent whole) goes to the worker too."""
    threads: list[tuple[str, bool]] = []

    def run_batch(calls, alone):
        threads.append((calls[0].sequence_id, threading.get_ident() == loop_thread))
        return [VerifyResult(0, 1, call.known_len + len(call.append), 0.0, batch_size=len(calls)) for call in calls]

    async def main():
        nonlocal loop_thread
        loop_thread = threading.get_ident()
        loop = asyncio.get_running_loop()
        run = lambda fn, *args: loop.run_in_executor(None, fn, *args)  # noqa: E731
        batcher = VerifyBatcher(run, run_batch, window_s=0.0, inline=lambda call: len(call.append) <= 2)
        await batcher.submit(VerifyCall("a", 0, [1, 2, 3], [], [], GREEDY))  # new: through the window
        await batcher.submit(VerifyCall("a", 3, [4], [], [], GREEDY))  # a step alone: inline
        await batcher.submit(VerifyCall("a", 0, [1, 2, 3, 4, 5], [], [], GREEDY))  # re-sent whole: the worker
        batcher.close()

    loop_thread = None
    asyncio.run(main())
    assert threads == [("a", False), ("a", True), ("a", False)]


def test_the_target_runs_a_step_inline_only_with_its_worker_idle_and_computing_alike(monkeypatch):
    from target_service import servicer as target_servicer

    servicer = target_servicer.TargetServicer()
    monkeypatch.setattr(target_servicer.TargetServicer, "_loop_computes_alike", True)
    step, prompt = VerifyCall("a", 3, [4], [5, 6], [], GREEDY), VerifyCall("a", 0, list(range(40)), [], [], GREEDY)
    assert servicer._inline(step) and not servicer._inline(prompt)
    assert not servicer._inline(dataclasses.replace(step, append=[], prefill=30))  # a prompt's next chunk
    servicer.host._in_flight.add(object())  # the worker busy (a release, an abandoned call)
    assert not servicer._inline(step)
    monkeypatch.setattr(target_servicer.TargetServicer, "_loop_computes_alike", False)
    servicer.host._in_flight.clear()
    assert not servicer._inline(step)
