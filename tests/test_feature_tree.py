"""Trees from a feature draft (draft_service/drafters/feature.py: FeatureTreeBuilder).

Each tree level is one draft forward over (parent's predicted feature, token) pairs under a tree
mask, so every node's distribution must be the one the chain computes, step by step, along that
node's root-to-node path; a one-branch tree must be the chain itself. Then the loop: greedy trees
give the target's own output and accept at least as many tokens per target pass as the chain, and
the target returns the accepted path's features so the next tree starts from true ones.
"""

from __future__ import annotations

import copy

import asyncio

import pytest
import torch

from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import GenerationSpec, Stats
from draft_service.drafters.feature import FeatureDrafter, FeatureTreeBuilder
from draft_service.engine import DraftEngine
from specdec.kv.store import Sequence
from specdec.model.features import FeatureRows
from specdec.model.lm import CausalLM
from specdec.model.gpu.static import StaticLM
from specdec.maths.costs import MODEL_DRAFT_PRIOR
from specdec.calls.request import ProposeCall, TreeSettings, VerifyCall
from specdec.maths.sampling import SamplingConfig
from specdec.maths.tree import DraftTree, path_to
from target_service.engine import TargetEngine
from tests import tiny

CPU = torch.device("cpu")
MAX_NEW = 24
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target():
    return tiny.one_layer_target(seed=3)


@pytest.fixture(scope="module")
def drafter(target):
    return FeatureDrafter(tiny.feature_draft_of(target, noise=0.3), CPU, [tiny.EOS])


@torch.inference_mode()
def final_hidden(model, tokens: list[int]) -> torch.Tensor:
    return model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]


def sequence(drafter: FeatureDrafter, target, tokens: list[int], lag: int = 0) -> Sequence:
    """A draft sequence holding `tokens` and the target's features of all but the last `1 + lag`
    (lag > 0: a run-ahead, whose last positions the draft walks with its own predictions)."""
    seq = Sequence("x", list(tokens))
    drafter.receive(seq, FeatureRows(0, final_hidden(target, tokens[:len(tokens) - 1 - lag])))
    return seq


@torch.inference_mode()
def chain_logits(drafter: FeatureDrafter, target, tokens: list[int], path: list[int], lag: int = 0) -> torch.Tensor:
    """The draft's logits [V] after `path`, computed as the chain does: one pair at a time, each
    (the previous predicted feature, the next token), on a fresh sequence."""
    seq = sequence(drafter, target, tokens, lag)
    feature, logits, _ = drafter._start(seq, seq.side)
    for token in path:
        feature, logits = drafter.model(feature, torch.tensor([[token]]), seq.cache, use_cache=True)
    return drafter.model.to_target_logits(logits[0, -1].float())


def tree_call(budget=16, top_k=4, depth=5, temperature=0.0, seed=0, shape=()) -> ProposeCall:
    return ProposeCall("x", 0, [], depth, temperature=temperature, seed=seed, tree=TreeSettings(budget, top_k, tuple(shape)))


def build(drafter, target, tokens, call, lag=0):
    seq = sequence(drafter, target, tokens, lag)
    builder = FeatureTreeBuilder(drafter, seq, seq.side, call)
    return builder, builder.build(), seq


@pytest.mark.parametrize("lag", [0, 3])
@pytest.mark.parametrize("call", [tree_call(), tree_call(shape=(3, 2, 2, 1)), tree_call(temperature=0.8, seed=3)])
def test_every_node_sees_what_the_chain_computes_along_its_path(drafter, target, call, lag):
    tokens = tiny.prompts(3, seed=5)[1]
    builder, tree, seq = build(drafter, target, tokens, call, lag)
    true_pairs = len(tokens) - 1 - lag
    assert seq.cached == true_pairs and seq.cache.get_seq_length() == true_pairs  # predicted pairs cropped away
    assert seq.tokens == tokens and len(tree.tokens) > 3
    parents = [n.parent for n in builder.nodes]
    fed = [i for i in builder.logits if i >= 0]
    assert len(fed) >= 2
    for i in [-1, *fed]:
        path = [builder.nodes[j].token for j in path_to(parents, i)] if i >= 0 else []
        expected = chain_logits(drafter, target, tokens, path, lag)
        got = builder.logits[i]
        finite = torch.isfinite(expected)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(torch.softmax(got, -1), torch.softmax(expected, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_one_branch_tree_is_the_chain(drafter, target, temperature):
    depth = 6
    for tokens in tiny.prompts(4, seed=9):
        features = FeatureRows(0, final_hidden(target, tokens[:-1]))
        engine = DraftEngine(drafter)
        chain = list(engine.propose(ProposeCall("c", 0, tokens, depth, 0.0, temperature, 5, features)))
        builder, tree, _ = build(drafter, target, tokens, tree_call(budget=depth, top_k=1, depth=depth, temperature=temperature, seed=5))
        assert tree.parents == list(range(-1, len(tree.tokens) - 1)) and len(tree.tokens) == depth
        if temperature == 0:
            assert tree.tokens == [p.token for p in chain]
            for node, proposal in zip(builder.nodes, chain):  # cumulative probabilities, step by step
                assert abs(node.logp - float(torch.tensor(proposal.cumulative_prob, dtype=torch.float64).log())) < 1e-5
            continue
        # sampled: each level's distribution is the chain's at that depth, along the tree's own tokens
        assert len(tree.child_dists) == depth + 1
        for k in range(depth):
            forced = list(engine.propose(ProposeCall(f"f{k}", 0, tokens + tree.tokens[:k], 1, 0.0, temperature, 5, features)))
            ids, probs = tree.child_dists[k]
            assert forced[0].dist[0] == ids
            torch.testing.assert_close(torch.tensor(forced[0].dist[1]), torch.tensor(probs), atol=1e-5, rtol=0)
        assert tree.tokens[0] == chain[0].token  # the same seed, the same distribution: the same first draw


def test_nothing_to_draft_from_yet_is_an_empty_tree(drafter):
    engine = DraftEngine(drafter)
    tree = engine.propose_tree(ProposeCall("e", 0, [1, 2, 3], 4, tree=TreeSettings(8, 2)))
    assert tree.tokens == [] and tree.parents == []


def _transformers_lm(target):
    return CausalLM(target, CPU)


def _fixed_shape_lm(target):  # the GPU path's passes, here on the CPU
    return StaticLM(copy.deepcopy(target), CPU, pass_rows=16, slots=4)


@pytest.mark.parametrize("make_lm", [_transformers_lm, _fixed_shape_lm], ids=["transformers", "fixed-shape"])
def test_the_target_returns_the_features_of_the_accepted_path(target, make_lm):
    engine = TargetEngine(make_lm(target))
    prompt = tiny.prompts(3, seed=7)[2]
    first = engine.verify(VerifyCall("s", 0, prompt, [], [], SamplingConfig(), return_features=True))
    expected = tiny.reference_greedy(target, prompt, 4)
    # a tree whose second branch is the target's own path: the path's features come back
    tree = DraftTree([-1, -1, 1, 2], [(expected[1] + 1) % 256, expected[1], expected[2], (expected[3] + 1) % 256])
    step = engine.verify(VerifyCall("s", len(prompt), [first.next_token], [], [], SamplingConfig(), tree, return_features=True))
    assert step.path == (1, 2) and step.features.start == len(prompt) and step.features.end == step.cached_len
    canonical = prompt + expected[:3]
    torch.testing.assert_close(step.features.values, final_hidden(target, canonical)[len(prompt):], atol=1e-4, rtol=1e-4)
    batched = TargetEngine(make_lm(target))
    calls = [VerifyCall("a", 0, prompt, [], [], SamplingConfig(), return_features=True),
             VerifyCall("b", 0, prompt[:5], [], [], SamplingConfig(), return_features=True)]
    heads = batched.verify_batch(calls)
    rows = batched.verify_batch([VerifyCall("a", len(prompt), [heads[0].next_token], [], [], SamplingConfig(), tree, return_features=True),
                                 VerifyCall("b", 5, [heads[1].next_token], [7], [], SamplingConfig(), return_features=True)])
    assert rows[0].path == (1, 2)
    torch.testing.assert_close(rows[0].features.values, step.features.values, atol=1e-4, rtol=1e-4)


def run_loop(target, drafter, prompt, tree: TreeSettings | None, draft_length: int, sampling=GREEDY):
    loop = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(target, CPU))), LocalProposer(DraftEngine(drafter)),
                           None, MODEL_DRAFT_PRIOR, features=True)
    spec = GenerationSpec("r", list(prompt), MAX_NEW, sampling, draft_length, False, frozenset({tiny.EOS}), seeded=True, tree=tree)
    stats = Stats()

    async def collect():
        return [t for step in [s async for s in loop.run(spec, stats)] for t in step.tokens]

    return asyncio.run(collect()), stats


@pytest.mark.parametrize("tree,draft_length", [(TreeSettings(8, 4), 4), (TreeSettings(16, 4), 5), (TreeSettings(10, 4, (3, 2, 1, 1)), 4)])
def test_greedy_feature_trees_give_the_target_alone_and_accept_at_least_the_chain(target, drafter, tree, draft_length):
    chain_tokens = tree_tokens = chain_steps = tree_steps = 0
    for prompt in tiny.prompts(6, seed=11):
        expected = tiny.reference_greedy(target, prompt, MAX_NEW)
        tokens, stats = run_loop(target, drafter, prompt, tree, draft_length)
        assert tokens == expected, prompt
        assert stats.draft_tokens > 0
        chained, chain_stats = run_loop(target, drafter, prompt, None, draft_length)
        assert chained == expected
        tree_tokens, tree_steps = tree_tokens + stats.completion_tokens, tree_steps + stats.steps
        chain_tokens, chain_steps = chain_tokens + chain_stats.completion_tokens, chain_steps + chain_stats.steps
    assert tree_tokens / tree_steps >= chain_tokens / chain_steps  # tokens per target pass


def test_sampled_feature_trees_repeat_with_a_seed(target, drafter):
    sampling = SamplingConfig(temperature=1.0, top_k=40, seed=21)
    prompt = tiny.prompts(2, seed=13)[1]
    first, stats = run_loop(target, drafter, prompt, TreeSettings(10, 3), 5, sampling)
    second, _ = run_loop(target, drafter, prompt, TreeSettings(10, 3), 5, sampling)
    assert first == second and stats.draft_tokens > 0 and stats.accepted_tokens > 0


def test_sampled_feature_trees_through_both_engines_follow_the_target_distribution(target):
    """The feature draft's trees (siblings drawn without replacement, p on the wire) verified by the
    target's recursive rejection sampling: the first emitted token follows q over seeded trials
    (a peaked draft against a flat q, so rejections and second siblings are common)."""
    from scipy import stats as scipy_stats

    from specdec.maths.sampling import target_probs

    t_engine = TargetEngine(CausalLM(target, CPU))
    d_engine = DraftEngine(FeatureDrafter(tiny.feature_draft_of(target, noise=0.3), CPU, [tiny.EOS], top_k=8))
    prompt = tiny.prompts(1, seed=21)[0]
    sampling = SamplingConfig(temperature=2.0, top_k=6)  # a flat q on 6 tokens; a peaked draft p on its top 8
    q = target_probs(t_engine.lm.forward(Sequence("q", list(prompt)), keep=1)[0], sampling).double()
    features = FeatureRows(0, final_hidden(target, prompt[:-1]))
    counts = torch.zeros_like(q)
    trials = 1000
    for trial in range(trials):
        first = trial == 0
        tree = d_engine.propose_tree(ProposeCall("s", 0 if first else len(prompt), prompt if first else [], 2, temperature=0.5,
                                                 seed=trial, features=features if first else None, tree=TreeSettings(6, 3)))
        assert len(tree.tokens) == 6
        call = VerifyCall("s", 0 if first else len(prompt), prompt if first else [], [], [], SamplingConfig(2.0, 6, seed=trial),
                          DraftTree(tree.parents, tree.tokens, tree.child_dists))
        result = t_engine.verify_tree(call)
        counts[tree.tokens[result.path[0]] if result.path else result.next_token] += 1
    support = q > 0
    assert counts[~support].sum() == 0
    pvalue = scipy_stats.chisquare(counts[support].numpy(), (q[support] / q[support].sum() * trials).numpy()).pvalue
    assert pvalue > 1e-4
