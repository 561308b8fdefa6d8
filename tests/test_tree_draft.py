"""Draft trees from a model (draft_service/tree.py), and the speculative loop over trees in process.

The draft's tree levels are fed in one pass each with a tree mask: a node's logits must equal those
of its path fed as a chain. Shapes obey the budget and the static shape; the draft keeps only the
canonical tokens afterwards; sampling trees carry distributions the target accepts as exact. Then
the loop (coordinator/loop.py with the in-process proposer and verifier): greedy trees of several
budgets and shapes give exactly the target's own output.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from specdec.maths.costs import MODEL_DRAFT_PRIOR
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import GenerationSpec, Stats
from draft_service.drafters.model import ModelDrafter
from draft_service.drafters.ngram import NgramDrafter
from draft_service.engine import DraftEngine
from draft_service.tree import TreeBuilder
from specdec.errors import InvalidArgument
from specdec.kv.store import Sequence
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from specdec.maths.tree import DraftTree
from specdec.calls.request import ProposeCall, TreeSettings, VerifyCall
from target_service.engine import TargetEngine
from specdec.maths.tree import depths, path_to
from tests.tiny import EOS, prompts, reference_greedy, tiny_pair

CPU = torch.device("cpu")
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


def settings(budget=16, top_k=4, shape=(), max_depth=6, temperature=0.0, seed=0, known_len=0, append=()) -> ProposeCall:
    """A tree Propose of sequence "s": its tree settings, its draft length (the depth), its sampling."""
    return ProposeCall("s", known_len, list(append), max_depth, temperature=temperature, seed=seed,
                       tree=TreeSettings(budget, top_k, tuple(shape)))


def build(lm, prompt, s: ProposeCall):
    seq = Sequence("x", list(prompt))
    builder = TreeBuilder(lm, seq, s, dist_top_k=32)
    return builder, builder.build(), seq


@pytest.mark.parametrize("s", [settings(), settings(shape=(3, 2, 2, 1)), settings(temperature=0.8, seed=3)])
def test_tree_node_logits_equal_their_path_fed_as_a_chain(pair, s):
    lm = CausalLM(pair[1], CPU)
    prompt = prompts(2, seed=5)[1]
    builder, _, seq = build(lm, prompt, s)
    assert seq.cached == len(prompt) and seq.tokens == prompt  # cropped back to the canonical tokens
    fed = [i for i in builder.logits if i >= 0]
    assert len(fed) >= 2
    parents = [n.parent for n in builder.nodes]
    for i in fed:
        path = [builder.nodes[j].token for j in path_to(parents, i)]
        chain = lm.forward(Sequence("c", list(prompt) + path), keep=1)[0]
        torch.testing.assert_close(builder.logits[i], chain, rtol=1e-4, atol=1e-4)


def test_greedy_dynamic_tree_keeps_the_most_probable_nodes_within_budget(pair):
    lm = CausalLM(pair[1], CPU)
    prompt = prompts(1, seed=2)[0]
    first = int(lm.forward(Sequence("c", list(prompt)), keep=1)[0].argmax())
    for budget in (1, 5, 16, 40):
        builder, tree, _ = build(lm, prompt, settings(budget=budget, top_k=4, max_depth=8))
        assert len(tree.tokens) == budget and not tree.child_dists
        assert all(-1 <= p < i for i, p in enumerate(tree.parents))
        assert tree.tokens[0] == first and tree.parents[0] == -1  # the draft's argmax leads
        parents = [n.parent for n in builder.nodes]
        spelled = {tuple(builder.nodes[j].token for j in path_to(parents, i)): builder.nodes[i].logp for i in range(len(parents))}
        kept = {tuple(tree.tokens[j] for j in path_to(tree.parents, i)) for i in range(len(tree.tokens))}
        dropped = [logp for path, logp in spelled.items() if path not in kept]
        assert kept <= set(spelled)
        if dropped:  # EAGLE-2's re-ranking: no dropped candidate is more probable than a kept node
            assert min(spelled[path] for path in kept) >= max(dropped) - 1e-9


def test_static_shape_and_budget(pair):
    lm = CausalLM(pair[1], CPU)
    prompt = prompts(1, seed=3)[0]
    _, tree, _ = build(lm, prompt, settings(budget=64, shape=(3, 2, 1), max_depth=8))
    d = depths(torch.tensor(tree.parents)).tolist()
    assert [d.count(k) for k in (1, 2, 3)] == [3, 6, 6] and len(d) == 15
    _, small, _ = build(lm, prompt, settings(budget=7, shape=(3, 2, 1), max_depth=8))
    assert len(small.tokens) == 7
    _, shallow, _ = build(lm, prompt, settings(budget=64, shape=(3, 2, 1), max_depth=2))
    assert max(depths(torch.tensor(shallow.parents)).tolist()) == 2


@pytest.mark.parametrize("shape", [(), (2, 2, 1)])
def test_sampling_tree_is_drawn_without_replacement_and_accepted_by_the_target(pair, shape):
    lm = CausalLM(pair[1], CPU)
    target = TargetEngine(CausalLM(pair[0], CPU))
    prompt = prompts(1, seed=4)[0]
    _, tree, _ = build(lm, prompt, settings(budget=12, top_k=4, shape=shape, temperature=0.9, seed=7))
    n = 12 if not shape else 2 + 4 + 4  # the static shape is full before the budget
    assert len(tree.tokens) == n and len(tree.child_dists) == n + 1
    for position in range(n + 1):
        kids = [tree.tokens[i] for i, p in enumerate(tree.parents) if p == position - 1]
        assert len(kids) == len(set(kids)), "siblings are drawn without replacement"
        assert bool(kids) == bool(tree.child_dists[position][0])
    sampling = SamplingConfig(temperature=0.9, seed=1)
    result = target.verify_tree(VerifyCall("s", 0, prompt, [], [], sampling, DraftTree(tree.parents, tree.tokens, tree.child_dists)))
    assert result.cached_len == len(prompt) + result.accepted
    _, again, _ = build(lm, prompt, settings(budget=12, top_k=4, shape=shape, temperature=0.9, seed=7))
    assert again == tree  # seeded


@pytest.mark.parametrize("bad,field", [
    (dict(budget=0), "tree.budget"), (dict(budget=65), "tree.budget"), (dict(max_depth=0), "tree.max_depth"),
    (dict(top_k=0), "tree.top_k"), (dict(top_k=17), "tree.top_k"), (dict(shape=(2, 0)), "tree.shape[1]"),
    (dict(shape=(1,) * 33), "tree.shape"), (dict(temperature=float("nan")), "temperature"),
])
def test_bad_tree_settings_are_invalid_arguments(pair, bad, field):
    engine = DraftEngine(ModelDrafter(CausalLM(pair[1], CPU)))
    with pytest.raises(InvalidArgument) as info:
        engine.propose_tree(settings(**bad, append=[1, 2, 3]))
    assert info.value.field == field


def test_ngram_drafter_sends_its_chain_as_a_tree():
    engine = DraftEngine(NgramDrafter())
    tree = engine.propose_tree(settings(budget=4, max_depth=3, append=[1, 2, 3, 1, 2, 3, 1, 2]))
    assert tree.parents == [-1, 0, 1] and tree.tokens == [3, 1, 2]


def run_loop(pair, prompt, tree: TreeSettings | None, draft_length: int, adaptive: bool = False, sampling=GREEDY):
    target, draft = pair
    loop = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(target, CPU))),
                           LocalProposer(DraftEngine(ModelDrafter(CausalLM(draft, CPU)))), None, MODEL_DRAFT_PRIOR)
    spec = GenerationSpec("r", list(prompt), 24, sampling, draft_length, adaptive, frozenset({EOS}), seeded=True, tree=tree)
    stats = Stats()

    async def collect():
        return [t for step in [s async for s in loop.run(spec, stats)] for t in step.tokens]

    return asyncio.run(collect()), stats


@pytest.mark.parametrize("tree,draft_length,adaptive", [
    (TreeSettings(4, 2), 4, False), (TreeSettings(12, 4), 6, False), (TreeSettings(32, 6), 8, True),
    (TreeSettings(10, 4, (3, 2, 1, 1)), 5, False), (TreeSettings(64, 16, (4, 2, 2, 2, 1)), 8, False), (TreeSettings(1, 1), 3, False),
])
def test_greedy_tree_loop_matches_the_target_alone(pair, tree, draft_length, adaptive):
    accepted = drafted = 0
    for prompt in prompts(6, seed=11):
        tokens, stats = run_loop(pair, prompt, tree, draft_length, adaptive)
        assert tokens == reference_greedy(pair[0], prompt, 24), f"prompt {prompt}"
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.draft_tokens
    assert 0 < accepted < drafted


def test_trees_accept_more_per_target_pass_than_the_chain(pair):
    chain = tree = 0.0
    for prompt in prompts(6, seed=12):
        chain += run_loop(pair, prompt, None, 4)[1].mean_accepted_length
        tree += run_loop(pair, prompt, TreeSettings(16, 4), 4)[1].mean_accepted_length
    assert tree > chain


def test_sampling_tree_loop_runs_and_repeats_with_a_seed(pair):
    sampling = SamplingConfig(temperature=1.0, top_k=40, seed=21)
    prompt = prompts(2, seed=13)[1]
    first, stats = run_loop(pair, prompt, TreeSettings(10, 3), 5, sampling=sampling)
    second, _ = run_loop(pair, prompt, TreeSettings(10, 3), 5, sampling=sampling)
    assert first == second and len(first) == 24 or EOS in first
    assert stats.draft_tokens > 0


@pytest.mark.slow  # test-all: the suite's time (issue 58); test_distribution's tree cases check sampled trees end to end
def test_sampled_trees_through_both_engines_follow_the_target_distribution(pair):
    """The draft's own tree drawing (siblings without replacement, p on the wire) and the target's
    reconstruction of each sibling's p agree: the first emitted token follows q over seeded trials.
    (A peaked draft against a flat q makes rejections common; judged with the plain rule, siblings
    against P itself, the same trials give p ~ 1e-20 here, against ~0.8 for the real rule.)"""
    from scipy import stats as scipy_stats

    target, draft = pair
    t_engine, d_engine = TargetEngine(CausalLM(target, CPU)), DraftEngine(ModelDrafter(CausalLM(draft, CPU), top_k=8))
    prompt = prompts(1, seed=21)[0]
    sampling = SamplingConfig(temperature=2.0, top_k=6)  # a flat q on 6 tokens; a peaked draft p on its top 8
    seq = Sequence("q", list(prompt))
    from specdec.maths.sampling import target_probs

    q = target_probs(t_engine.lm.forward(seq, keep=1)[0], sampling).double()
    counts = torch.zeros_like(q)
    trials = 2500
    for trial in range(trials):
        tree = d_engine.propose_tree(settings(budget=6, top_k=3, max_depth=2, temperature=0.5, seed=trial,
                                              known_len=len(prompt) if trial else 0, append=[] if trial else prompt))
        call = VerifyCall("s", len(prompt) if trial else 0, [] if trial else prompt, [], [],
                          dataclasses.replace(sampling, seed=trial), DraftTree(tree.parents, tree.tokens, tree.child_dists))
        result = t_engine.verify_tree(call)
        first = tree.tokens[result.path[0]] if result.path else result.next_token
        counts[first] += 1
    support = q > 0
    assert counts[~support].sum() == 0
    pvalue = scipy_stats.chisquare(counts[support].numpy(), (q[support] / q[support].sum() * trials).numpy()).pvalue
    assert pvalue > 1e-4


@pytest.mark.parametrize("seeded", [False, True])
def test_the_load_cap_bounds_tree_nodes_except_for_seeded_requests(pair, seeded):
    from specdec.maths.costs import CostModel

    target, draft = pair
    cost_model = CostModel(MODEL_DRAFT_PRIOR)
    cost_model.draft_cap = lambda: 3  # the verify token budget left per request under load
    loop = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(target, CPU))),
                           LocalProposer(DraftEngine(ModelDrafter(CausalLM(draft, CPU)))), cost_model, MODEL_DRAFT_PRIOR)
    prompt = prompts(1, seed=15)[0]
    spec = GenerationSpec("r", list(prompt), 12, GREEDY, 4, False, frozenset({EOS}), seeded=seeded, tree=TreeSettings(12, 4))
    stats = Stats()

    async def collect():
        return [t for step in [s async for s in loop.run(spec, stats)] for t in step.tokens]

    assert asyncio.run(collect()) == reference_greedy(target, prompt, 12)
    per_step = stats.draft_tokens / stats.draft_steps
    assert per_step <= 3 if not seeded else per_step > 3
