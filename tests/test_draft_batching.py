"""Draft-side batching: chains drafted in shared forwards propose exactly what they propose alone.

Engine level (forward_rows against one forward per sequence, model and pruned drafts, through
rollbacks), the draft service's batcher through gRPC (concurrent streams, greedy and seeded
sampling, against a server with batching off), and the whole stack (concurrent requests equal the
target's own greedy output while the draft really batched).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses

import grpc
import pytest
import torch

from specdec.calls.request import ProposeCall
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.model.lm import CausalLM
from specdec.serving.batcher import Requeue
from specdec.model.pruned import PrunedCausalLM, PrunedDraft
from tests import tiny
from tests.stack import Stack


def _engine(lm) -> DraftEngine:
    return DraftEngine(ModelDrafter(lm))


def test_a_long_catch_up_is_fed_in_chunks_between_the_other_rows():
    """A 120-token prompt's catch-up, at most 16 tokens a pass, beside a short row: the short row
    gets its logits every pass, the long one comes back as Requeue until its last chunk, and its
    logits then are those of the catch-up fed whole."""
    target, _ = tiny.tiny_pair()
    chunked = DraftEngine(ModelDrafter(CausalLM(target, torch.device("cpu"))), max_prefill_tokens=16)
    whole = _engine(CausalLM(target, torch.device("cpu")))
    long_prompt, short = (tiny.prompts(1, seed=8)[0] * 20)[:120], tiny.prompts(2, seed=9)[1][:5]
    greedy = ProposeCall("", 0, [], 8)
    for engine in (chunked, whole):
        engine.open(dataclasses.replace(greedy, sequence_id="long", append=long_prompt))
        engine.open(dataclasses.replace(greedy, sequence_id="short", append=short))
    seqs = [chunked.store.sync("long", len(long_prompt), []), chunked.store.sync("short", len(short), [])]
    passes = 0
    while True:
        passes += 1
        long_out, short_out = chunked.forward_rows(seqs)
        assert isinstance(short_out, torch.Tensor)
        seqs[1].tokens.append(int(short_out.argmax()))
        if not isinstance(long_out, Requeue):
            break
        assert long_out.call is seqs[0]
    assert passes == 8  # 7 chunks of 16, then the last 8 tokens with the logits
    expected = whole.forward_rows([whole.store.sync("long", len(long_prompt), [])])[0]
    assert torch.allclose(long_out, expected, atol=1e-5) and int(long_out.argmax()) == int(expected.argmax())


def _check_rows_match(make_lm):
    """Four sequences of different lengths, stepped together and alone, with a rollback between."""
    batched, alone = _engine(make_lm()), _engine(make_lm())
    prompts = tiny.prompts(4, seed=5)
    greedy = ProposeCall("", 0, [], 8)
    for engine in (batched, alone):
        for i, prompt in enumerate(prompts):
            engine.open(dataclasses.replace(greedy, sequence_id=f"s{i}", append=prompt))
    seqs_b = [batched.store.sync(f"s{i}", len(p), []) for i, p in enumerate(prompts)]
    seqs_a = [alone.store.sync(f"s{i}", len(p), []) for i, p in enumerate(prompts)]
    for step in range(6):
        if step == 3:  # the target rejected the last two drafts of rows 0 and 2: roll back, catch up
            for seqs, engine in ((seqs_b, batched), (seqs_a, alone)):
                for i in (0, 2):
                    keep = len(seqs[i].tokens) - 2
                    engine.store.sync(f"s{i}", keep, [7])
        rows = batched.forward_rows(seqs_b)
        for seq_a, seq_b, logits in zip(seqs_a, seqs_b, rows):
            expected = alone.forward_rows([seq_a])[0]
            assert logits.shape == expected.shape
            finite = torch.isfinite(expected)
            assert torch.equal(finite, torch.isfinite(logits))
            assert torch.allclose(logits[finite], expected[finite], atol=1e-4)
            token = int(expected.argmax())
            assert int(logits.argmax()) == token
            seq_a.tokens.append(token)
            seq_b.tokens.append(token)
            assert seq_b.cached == seq_a.cached == len(seq_a.tokens) - 1
    assert batched.drafter.forwards == alone.drafter.forwards


def test_forward_rows_match_one_forward_per_sequence():
    _, draft = tiny.tiny_pair(seed=0)
    _check_rows_match(lambda: CausalLM(copy.deepcopy(draft), torch.device("cpu")))


def test_pruned_draft_rows_match_and_stay_in_the_target_vocabulary():
    torch.manual_seed(0)
    model = PrunedDraft(tiny.tiny_config(layers=2), kept_ids=list(range(0, tiny.VOCAB, 3))).eval()
    _check_rows_match(lambda: PrunedCausalLM(copy.deepcopy(model), torch.device("cpu")))


def test_engine_says_which_chains_batch():
    target, draft = tiny.tiny_pair(seed=0)
    engine = _engine(CausalLM(draft, torch.device("cpu")))
    assert engine.batches(ProposeCall("s", 0, [], 4))
    engine.drafter.staged = True  # staged greedy speculates its own forwards: it drafts alone
    assert not engine.batches(ProposeCall("s", 0, [], 4))
    assert engine.batches(ProposeCall("s", 0, [], 4, 0.0, 0.8, 0))


# --- through gRPC ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target, draft = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("tiny")
    target_path, draft_path = tiny.save(target, folder / "target"), tiny.save(draft, folder / "draft")
    stack = Stack()
    batched = stack.draft(drafter="model", model=draft_path, batch_window_ms=20.0)
    alone = stack.draft(drafter="model", model=draft_path, max_batch_size=1)
    yield {"stack": stack, "batched": batched, "alone": alone, "batcher": stack.servers[0].servicer.batcher,
           "target": target, "target_path": target_path}
    stack.stop()


def _propose_all(address: str, settings: dict, count: int = 6) -> list[list[tuple[int, tuple]]]:
    """`count` sequences: each a fresh Propose, then a second one after a partial rollback."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.DraftServiceStub(channel)
    prompts = tiny.prompts(count, seed=11)

    def one(i: int) -> list[tuple[int, tuple]]:
        out = []
        seq_id = f"seq-{i}-{settings.get('temperature', 0)}"
        first = list(stub.Propose(pb.ProposeRequest(sequence_id=seq_id, known_len=0, append_tokens=prompts[i], **settings), timeout=60))
        out += [(m.token_id, tuple(m.dist.probs)) for m in first]
        accepted = [m.token_id for m in first[: len(first) // 2]]
        second = stub.Propose(pb.ProposeRequest(sequence_id=seq_id, known_len=len(prompts[i]), append_tokens=accepted + [5],
                                                **settings), timeout=60)
        out += [(m.token_id, tuple(m.dist.probs)) for m in second]
        stub.Release(pb.DraftServiceReleaseRequest(sequence_id=seq_id), timeout=10)
        return out

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        results = list(pool.map(one, range(count)))
    channel.close()
    return results


@pytest.mark.parametrize("settings", [{"max_tokens": 8}, {"max_tokens": 6, "temperature": 0.8, "seed": 3}],
                         ids=["greedy", "seeded-sampling"])
def test_concurrent_streams_propose_what_they_propose_alone(env, settings):
    batcher = env["batcher"]
    batches, rows = batcher.batches, batcher.rows
    got = _propose_all(env["batched"], settings)
    expected = _propose_all(env["alone"], settings)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in expected]
    for mine, theirs in zip(got, expected):
        for (_, p), (_, q) in zip(mine, theirs):
            assert p == pytest.approx(q, abs=1e-5)
    assert all(len(r) > 8 for r in got)
    assert batcher.rows - rows > batcher.batches - batches, "no forward carried more than one stream"


def test_concurrent_requests_through_a_batching_draft_equal_the_target(env):
    stack = env["stack"]
    target_addr = stack.target(env["target_path"])
    client = stack.client(stack.coordinator(target_addr, env["batched"], tiny.byte_tokenizer()))
    prompts = tiny.prompts(8, seed=2)
    batcher = env["batcher"]
    batches, rows = batcher.batches, batcher.rows

    def generate(prompt):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=20,
                                     speculation=pb.SpeculationParams(draft_length=4, adaptive=False))
        return list(client.Generate(request, timeout=120).token_ids)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(generate, prompts))
    assert outputs == [tiny.reference_greedy(env["target"], p, 20) for p in prompts]
    assert batcher.rows - rows > batcher.batches - batches


def test_a_stream_cancelled_mid_draft_leaves_the_sequence_as_a_rollback_expects(env):
    """The drafter runs ahead of the stream on the worker thread (DraftServicer._propose_alone). A
    client that cancels after one token (a coordinator dropping a run-ahead) must find the sequence
    the same as one that read the whole stream: the next call's rollback sees every token the
    worker appended, because the handler ends only after the worker stops."""
    channel = grpc.insecure_channel(env["alone"])
    stub = pb_grpc.DraftServiceStub(channel)
    prompt = tiny.prompts(1, seed=23)[0]
    expected = []
    for seq_id, cancel in (("whole", False), ("cancelled", True)):
        stream = stub.Propose(pb.ProposeRequest(sequence_id=seq_id, known_len=0, append_tokens=prompt, max_tokens=16), timeout=60)
        first = next(stream).token_id
        if cancel:
            stream.cancel()
        else:
            list(stream)
        # at once, as the coordinator does: the target kept the first token and corrected the second
        follow = stub.Propose(pb.ProposeRequest(sequence_id=seq_id, known_len=len(prompt), append_tokens=[first, 3],
                                                max_tokens=8), timeout=60)
        expected.append([m.token_id for m in follow])
        stub.Release(pb.DraftServiceReleaseRequest(sequence_id=seq_id), timeout=10)
    channel.close()
    assert expected[0] == expected[1] and len(expected[0]) == 8
