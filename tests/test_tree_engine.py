"""Target-side tree verification in one forward pass, on tiny models (target_service/engine.py).

Greedy: decoding with trees of many shapes and budgets gives exactly the target's own greedy output;
the cache after a tree step is the cache a chain of the accepted path leaves; a chain-shaped tree
is verified exactly as the chain itself (greedy and seeded sampling); bad trees are rejected
naming the field.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from specdec.maths.tree import DraftTree
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from tests.tiny import EOS, prompts, reference_greedy, tiny_pair

GREEDY = SamplingConfig()
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def target():
    return tiny_pair()[0]


def engine(model) -> TargetEngine:
    return TargetEngine(CausalLM(model, torch.device("cpu")), max_sequences=64)


def random_tree(rng: random.Random, budget: int, continuation: list[int]) -> DraftTree:
    """A random tree of `budget` nodes with random tokens; usually one root-to-node path spells
    (a possibly corrupted prefix of) the target's continuation, so steps mix accepts and rejects."""
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, budget)] if budget else []
    tokens = [rng.randrange(256) for _ in range(budget)]
    if budget and continuation and rng.random() < 0.8:
        node = rng.randrange(budget)
        path = []
        while node != -1:
            path.append(node)
            node = parents[node]
        for depth, node in enumerate(reversed(path)):
            if depth < len(continuation):
                tokens[node] = continuation[depth]
        if rng.random() < 0.3:
            tokens[rng.choice(path)] = rng.randrange(256)  # a wrong guess on the good branch
    return DraftTree(parents, tokens)


@pytest.mark.parametrize("budgets,trees", [((1, 2, 3), True), ((4, 8), True), ((12, 16, 24), True), ((0, 5, 32, 64), True), ((6, 10), False)])
def test_greedy_tree_decoding_equals_the_target_alone(target, budgets, trees):
    eng = engine(target)
    eng.trees = trees  # False: the fallback that verifies the chain of first children
    rng = random.Random(sum(budgets))
    for index, prompt in enumerate(prompts(5, seed=len(budgets))):
        reference = reference_greedy(target, prompt, NEW_TOKENS)
        tokens, known, name = list(prompt), 0, f"s{index}"
        while len(tokens) - len(prompt) < len(reference) and tokens[-1:] != [EOS]:
            at = len(tokens) - len(prompt)
            tree = random_tree(rng, rng.choice(budgets), reference[at:])
            result = eng.verify_tree(VerifyCall(name, known, tokens[known:], [], [], GREEDY, tree))
            assert result.accepted == len(result.path)
            assert all(tree.parents[b] == a for a, b in zip((-1, *result.path), result.path)), "not a root-to-node path"
            tokens += [tree.tokens[i] for i in result.path] + [result.next_token]
            known = result.cached_len
            assert known == len(tokens) - 1
        generated = tokens[len(prompt):]
        assert generated[:len(reference)] == reference, f"prompt {index}"


def test_cache_after_a_tree_step_equals_the_cache_of_the_accepted_chain(target):
    prompt = prompts(3, seed=4)[1]
    reference = reference_greedy(target, prompt, 8)
    # The good branch is not the first one, and other branches are fed around it.
    wrong = [(t + 1) % 256 for t in reference]
    tree = DraftTree([-1, -1, 0, 1, 1, 3, 4, 5], [wrong[0], reference[0], 7, wrong[1], reference[1], 11, reference[2], 13])
    a, b = engine(target), engine(target)
    tree_result = a.verify_tree(VerifyCall("x", 0, prompt, [], [], GREEDY, tree))
    assert tree_result.path == (1, 4, 6) and tree_result.next_token == reference[3]
    chain_result = b.verify(VerifyCall("x", 0, prompt, reference[:3], [], GREEDY))
    assert chain_result.accepted == 3 and chain_result.next_token == tree_result.next_token
    seq_a, seq_b = a.store.sync("x", len(prompt) + 3, [tree_result.next_token]), b.store.sync("x", len(prompt) + 3, [chain_result.next_token])
    assert seq_a.tokens == seq_b.tokens and seq_a.cached == seq_b.cached == len(prompt) + 3
    for layer_a, layer_b in zip(seq_a.cache.layers, seq_b.cache.layers):
        assert layer_a.keys.shape == layer_b.keys.shape
        torch.testing.assert_close(layer_a.keys, layer_b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer_a.values, layer_b.values, rtol=1e-4, atol=1e-5)
    # and the next step's logits agree
    torch.testing.assert_close(a.lm.forward(seq_a, [5, 6], keep=3), b.lm.forward(seq_b, [5, 6], keep=3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.9, top_k=20, seed=3), SamplingConfig(temperature=1.2, top_p=0.9, seed=8)])
def test_a_chain_shaped_tree_verifies_exactly_as_the_chain(target, sampling):
    """Same tokens, same seeded draws: the tree rule on a chain is the chain rule."""
    gen = torch.Generator().manual_seed(1)
    a, b = engine(target), engine(target)
    tokens, known = list(prompts(2, seed=9)[0]), 0
    for step in range(12):
        gamma = step % 5
        draft = torch.randint(0, 256, (gamma,), generator=gen).tolist()
        dists = []
        if not sampling.greedy:
            for token in draft:  # a valid p for each draft token: its own support includes it
                ids = sorted({token, *torch.randint(0, 256, (4,), generator=gen).tolist()})
                probs = torch.softmax(torch.randn(len(ids), generator=gen), -1).tolist()
                probs[-1] = 1.0 - sum(probs[:-1])
                dists.append((ids, probs))
        tree = DraftTree(list(range(-1, gamma - 1)), draft, dists + [([], [])] if dists else [])  # position j: node j's p
        chain = b.verify(VerifyCall("s", known, tokens[known:], draft, dists, sampling))
        via_tree = a.verify_tree(VerifyCall("s", known, tokens[known:], [], [], sampling, tree))
        assert (via_tree.accepted, via_tree.next_token, via_tree.cached_len) == (chain.accepted, chain.next_token, chain.cached_len)
        tokens += draft[:chain.accepted] + [chain.next_token]
        known = chain.cached_len


def test_sampling_tree_steps_are_reproducible_and_follow_the_path(target):
    sampling = SamplingConfig(temperature=1.0, top_k=30, seed=5)
    parents = [-1, -1, -1, 0, 0, 1]
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(7, 256, generator=gen), -1)
    top = probs.topk(8).indices
    dists = []
    for j in range(7):
        ids = top[j].tolist()
        p = probs[j, top[j]] / probs[j, top[j]].sum()
        dists.append((ids, p.tolist()) if j in (0, 1, 2) else ([], []))
    tokens = [top[0, 0].item(), top[0, 1].item(), top[0, 2].item(), top[1, 0].item(), top[1, 3].item(), top[2, 5].item()]
    tree = DraftTree(parents, tokens, dists)
    prompt = prompts(1, seed=3)[0]
    first = engine(target).verify_tree(VerifyCall("s", 0, prompt, [], [], sampling, tree))
    second = engine(target).verify_tree(VerifyCall("s", 0, prompt, [], [], sampling, tree))
    assert (first.path, first.next_token, first.cached_len) == (second.path, second.next_token, second.cached_len)
    assert all(parents[b] == a for a, b in zip((-1, *first.path), first.path))


@pytest.mark.parametrize("tree,draft,field", [
    (DraftTree([0], [1]), [], "draft_tree.parents[0]"),
    (DraftTree([-1, 2, 1], [1, 2, 3]), [], "draft_tree.parents[1]"),
    (DraftTree([-1, -1], [1]), [], "draft_tree.parents"),
    (DraftTree([-1], [999]), [], "draft_tree.tokens"),
    (DraftTree([-1] * 65, [1] * 65), [], "draft_tree.tokens"),
    (DraftTree([-1], [1], [([1], [1.0])]), [], "draft_tree.child_dists"),
    (DraftTree([-1], [1], [([1, 2], [0.7, 0.7]), ([], [])]), [], "draft_tree.child_dists[0]"),
    (DraftTree([-1], [1]), [4], "draft_tree"),
])
def test_bad_trees_are_invalid_arguments_naming_the_field(target, tree, draft, field):
    with pytest.raises(InvalidArgument) as info:
        engine(target).verify_tree(VerifyCall("s", 0, [1, 2, 3], draft, [], SamplingConfig(temperature=1.0), tree))
    assert info.value.field == field


def test_a_sibling_its_distribution_could_not_have_drawn_is_rejected(target):
    tree = DraftTree([-1, -1], [5, 5], [([5, 6], [0.5, 0.5]), ([], []), ([], [])])  # 5 drawn twice without replacement
    with pytest.raises(InvalidArgument) as info:
        engine(target).verify_tree(VerifyCall("s", 0, [1, 2], [], [], SamplingConfig(temperature=1.0), tree))
    assert info.value.field == "draft_tree.child_dists[0]"


def test_batched_tree_rows_equal_unbatched_and_the_target_alone(target):
    """Tree rows and chain rows share one padded pass (per-row 4D masks); each row's verdict and
    cache equal those of verifying it alone, and decoding gives the target's own output."""
    rng = random.Random(5)
    batched, single = engine(target), engine(target)
    pool = prompts(6, seed=6)
    refs = [reference_greedy(target, p, NEW_TOKENS) for p in pool]
    state = [{"tokens": list(p), "known": 0} for p in pool]
    sizes = []
    for _ in range(40):
        live = [i for i, s in enumerate(state) if len(s["tokens"]) - len(pool[i]) < len(refs[i]) and s["tokens"][-1:] != [EOS]]
        if not live:
            break
        step = [i for i in live if rng.random() < 0.8] or live[:1]
        calls = []
        for i in step:
            s, at = state[i], len(state[i]["tokens"]) - len(pool[i])
            if rng.random() < 0.6:
                call = VerifyCall(f"s{i}", s["known"], s["tokens"][s["known"]:], [], [], GREEDY, random_tree(rng, rng.choice([1, 4, 9, 16]), refs[i][at:]))
            else:
                call = VerifyCall(f"s{i}", s["known"], s["tokens"][s["known"]:], refs[i][at:at + rng.choice([0, 2, 5])], [], GREEDY)
            calls.append(call)
        results = batched.verify_batch(calls)
        for i, call, result in zip(step, calls, results):
            alone = single.verify_tree(call) if call.tree is not None else single.verify_batch([call])[0]
            assert (result.path, result.accepted, result.next_token, result.cached_len) == (alone.path, alone.accepted, alone.next_token, alone.cached_len)
            drafted = [call.tree.tokens[j] for j in result.path] if call.tree is not None else call.draft_tokens[:result.accepted]
            state[i]["tokens"] += drafted + [result.next_token]
            state[i]["known"] = result.cached_len
        sizes.append(len(step))
    for i, p in enumerate(pool):
        assert state[i]["tokens"][len(p):][:len(refs[i])] == refs[i], f"prompt {i}"
    assert max(sizes) >= 3
    # the caches the batch wrote back equal the ones built alone
    for i in range(len(pool)):
        a, b = batched.store.sync(f"s{i}", state[i]["known"], []), single.store.sync(f"s{i}", state[i]["known"], [])
        for layer_a, layer_b in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(layer_a.keys, layer_b.keys, rtol=1e-4, atol=1e-4)


def test_batched_sampling_tree_rows_equal_unbatched(target):
    sampling = [SamplingConfig(temperature=0.9, seed=s) for s in (1, 2, 3)]
    gen = torch.Generator().manual_seed(3)
    calls = []
    for i, prompt in enumerate(prompts(3, seed=10)):
        parents = [-1, -1, 0, 0, 1, 2][: 2 + 2 * i]
        probs = torch.softmax(torch.randn(len(parents) + 1, 256, generator=gen) * 3, -1)
        top = probs.topk(6).indices
        dists, tokens = [], []
        for j in range(len(parents) + 1):
            p = probs[j, top[j]] / probs[j, top[j]].sum()
            dists.append((top[j].tolist(), p.tolist()))
        seen: dict[int, int] = {}
        for parent in parents:  # the k-th child of a position takes its k-th top token (distinct siblings)
            k = seen.get(parent, 0)
            seen[parent] = k + 1
            tokens.append(int(top[parent + 1, k]))
        calls.append(VerifyCall(f"t{i}", 0, prompt, [], [], sampling[i], DraftTree(parents, tokens, dists)))
    calls.append(VerifyCall("chain", 0, prompts(4, seed=10)[3], [5, 6], [([5, 9], [0.5, 0.5]), ([6], [1.0])], sampling[0]))
    batched = engine(target).verify_batch(calls)
    for call, result in zip(calls, batched):
        alone = engine(target).verify_batch([call])[0]
        assert result.batch_size == 4
        assert (result.path, result.accepted, result.next_token, result.cached_len) == (alone.path, alone.accepted, alone.next_token, alone.cached_len)
