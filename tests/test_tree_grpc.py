"""Tree drafts end to end through the three real gRPC servers on loopback, with tiny random models.

Greedy output equals the target's own generate() for several dynamic and static tree shapes and
budgets (model draft), with the n-gram drafter (its chain travels as a one-branch tree), and with
a coordinator whose default is trees; sampling runs through and repeats with a seed; bad tree
settings are INVALID_ARGUMENT naming the field, at the coordinator and at each backend.
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests import tiny
from tests.stack import Stack

MAX_NEW = 24


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target, draft = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("tiny")
    target_path = tiny.save(target, folder / "target")
    draft_path = tiny.save(draft, folder / "draft")
    stack = Stack()
    tokenizer = tiny.byte_tokenizer()
    target_addr = stack.target(target_path)
    model_draft = stack.draft(drafter="model", model=draft_path)
    ngram_draft = stack.draft(drafter="ngram")
    clients = {
        "model": stack.client(stack.coordinator(target_addr, model_draft, tokenizer)),
        "ngram": stack.client(stack.coordinator(target_addr, ngram_draft, tokenizer)),
        "tree-default": stack.client(stack.coordinator(target_addr, model_draft, tokenizer, tree_budget=10, tree_shape="3,2,1")),
    }
    channels = [grpc.insecure_channel(a) for a in (target_addr, model_draft)]
    yield {"target": target, "clients": clients, "stack": stack,
           "target_stub": pb_grpc.TargetServiceStub(channels[0]), "draft_stub": pb_grpc.DraftServiceStub(channels[1])}
    for channel in channels:
        channel.close()
    stack.stop()


@pytest.fixture(scope="module")
def references(env):
    return [tiny.reference_greedy(env["target"], p, MAX_NEW) for p in tiny.prompts(8)]


def generate(client, prompt, sampling=None, **speculation) -> pb.GenerateResponse:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW,
                                 speculation=pb.SpeculationParams(**speculation), sampling=sampling)
    return client.Generate(request, timeout=60)


@pytest.mark.parametrize("speculation", [
    dict(tree_budget=1, draft_length=4, adaptive=False),
    dict(tree_budget=6, tree_top_k=2, draft_length=4, adaptive=False),
    dict(tree_budget=16, tree_top_k=4, draft_length=6, adaptive=False),
    dict(tree_budget=48, tree_top_k=8, draft_length=8, adaptive=True),
    dict(tree_budget=64, tree_shape=[4, 2, 2, 1, 1], draft_length=8, adaptive=False),
    dict(tree_budget=7, tree_shape=[1, 3, 1], draft_length=3, adaptive=False),
])
def test_greedy_tree_drafts_match_the_target_alone(env, references, speculation):
    drafted = accepted = steps = 0
    for prompt, expected in zip(tiny.prompts(8), references):
        response = generate(env["clients"]["model"], prompt, **speculation)
        assert list(response.token_ids) == expected, f"prompt {prompt}"
        drafted += response.stats.draft_tokens
        accepted += response.stats.accepted_tokens
        steps += response.stats.steps
    assert 0 < accepted < drafted  # speculation really happened, with accepts and rejects
    assert drafted <= speculation["tree_budget"] * steps


def test_ngram_chain_as_a_tree_and_the_coordinators_tree_default(env, references):
    for prompt, expected in zip(tiny.prompts(8), references):
        assert list(generate(env["clients"]["ngram"], prompt, tree_budget=8, draft_length=6).token_ids) == expected
        assert list(generate(env["clients"]["tree-default"], prompt).token_ids) == expected
    tree = generate(env["clients"]["tree-default"], tiny.prompts(8)[0], draft_length=4, adaptive=False)
    assert tree.stats.draft_tokens > tree.stats.steps  # more than one node per step: it was a tree


@pytest.mark.parametrize("speculation", [dict(tree_budget=10, tree_top_k=3), dict(tree_budget=9, tree_shape=[3, 2])])
def test_seeded_sampling_with_trees_runs_and_repeats(env, speculation):
    client = env["clients"]["model"]
    prompt = tiny.prompts(8)[1]
    sampling = pb.SamplingParams(temperature=1.0, top_k=50, seed=77)
    first = generate(client, prompt, sampling=sampling, draft_length=5, **speculation)
    second = generate(client, prompt, sampling=sampling, draft_length=5, **speculation)
    assert list(first.token_ids) == list(second.token_ids)
    assert first.stats.draft_tokens > 0 and first.stats.completion_tokens == len(first.token_ids)


def _field(exc: grpc.RpcError) -> str:
    status = rpc_status.from_call(exc)
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bad.field_violations[0].field
    return ""


@pytest.mark.parametrize("speculation,field", [
    (dict(tree_budget=65), "speculation.tree_budget"),
    (dict(tree_budget=-1), "speculation.tree_budget"),
    (dict(tree_budget=4, tree_top_k=0), "speculation.tree_top_k"),
    (dict(tree_budget=4, tree_shape=[2, 17]), "speculation.tree_shape[1]"),
])
def test_bad_tree_settings_at_the_coordinator(env, speculation, field):
    with pytest.raises(grpc.RpcError) as info:
        generate(env["clients"]["model"], [1, 2, 3], **speculation)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(info.value) == field


@pytest.mark.parametrize("tree,field", [
    (pb.DraftTree(parents=[0], tokens=[1]), "draft_tree.parents[0]"),
    (pb.DraftTree(parents=[-1, 1], tokens=[1, 2]), "draft_tree.parents[1]"),
    (pb.DraftTree(parents=[-1], tokens=[1, 2]), "draft_tree.parents"),
    (pb.DraftTree(parents=[-1], tokens=[4000]), "draft_tree.tokens"),
])
def test_bad_trees_at_the_target(env, tree, field):
    request = pb.VerifyRequest(sequence_id="bad-tree", known_len=0, append_tokens=[1, 2], draft_tree=tree)
    with pytest.raises(grpc.RpcError) as info:
        env["target_stub"].Verify(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(info.value) == field


@pytest.mark.parametrize("params,field", [
    (pb.TreeParams(budget=0, top_k=2, max_depth=3), "tree.budget"),
    (pb.TreeParams(budget=4, top_k=2, max_depth=33), "tree.max_depth"),
    (pb.TreeParams(budget=4, top_k=99, max_depth=3), "tree.top_k"),
])
def test_bad_tree_params_at_the_draft(env, params, field):
    request = pb.ProposeTreeRequest(sequence_id="bad-tree", known_len=0, append_tokens=[1, 2], tree=params)
    with pytest.raises(grpc.RpcError) as info:
        env["draft_stub"].ProposeTree(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(info.value) == field
