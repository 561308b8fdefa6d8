"""Tree drafts: layout helpers, greedy tree verification, and the losslessness of the sibling rule."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.maths.tree import (
    ancestor_mask,
    check_parents,
    children,
    depths,
    path_to,
    verify_tree_greedy,
    verify_tree_rejection,
    without_replacement_probs,
)
from tests.test_verify import FALSE_ALARM, _chi_square_pvalue

#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
PARENTS = [-1, -1, 0, 0, 1, 2]


def test_layout_helpers():
    parents = torch.tensor(PARENTS)
    assert depths(parents).tolist() == [1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(parents)
    assert mask.shape == (7, 7)
    assert mask[0].tolist() == [True] + [False] * 6  # the root sees itself only
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]  # node 5: root, 0, 2, itself
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]  # node 4: root, 1, itself
    assert mask[:, 0].all()  # every position sees the root
    assert path_to(PARENTS, 5) == [0, 2, 5] and path_to(PARENTS, -1) == []
    assert children(PARENTS, -1) == [0, 1] and children(PARENTS, 0) == [2, 3] and children(PARENTS, 5) == []


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, 5, 0], [-2], [-1, 0, 3, 1]])
def test_malformed_parents_are_rejected_naming_the_node(bad):
    with pytest.raises(InvalidArgument) as info:
        check_parents(bad)
    first_bad = next(i for i, p in enumerate(bad) if not -1 <= p < i)
    assert info.value.field == f"draft_tree.parents[{first_bad}]"


def _logits_from_argmax(argmax: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_greedy_takes_the_deepest_matching_path_and_the_target_token_after_it():
    tokens = torch.tensor([7, 3, 1, 4, 2, 9])
    # target argmax at root, nodes 0..5: after root 3 (node 1 matches, node 0 does not), after node 1: 2
    verdict = verify_tree_greedy(_logits_from_argmax([3, 1, 2, 0, 0, 8, 0]), tokens, torch.tensor(PARENTS))
    assert verdict.path == [1, 4] and verdict.next_token == 8  # argmax at node 4


def test_greedy_prefers_the_deeper_of_two_matching_branches():
    tokens = torch.tensor([7, 3, 1, 4, 2, 9])
    # root -> 7 (node 0) -> 1 (node 2) -> 9 (node 5): depth 3 beats node 1's depth-2 branch
    verdict = verify_tree_greedy(_logits_from_argmax([7, 1, 0, 9, 0, 0, 6]), tokens, torch.tensor(PARENTS))
    assert verdict.path == [0, 2, 5] and verdict.next_token == 6


def test_greedy_with_no_match_or_no_nodes_is_a_plain_step():
    tokens = torch.tensor([7, 3, 1, 4, 2, 9])
    verdict = verify_tree_greedy(_logits_from_argmax([5, 1, 2, 0, 0, 8, 0]), tokens, torch.tensor(PARENTS))
    assert verdict.path == [] and verdict.next_token == 5
    empty = verify_tree_greedy(_logits_from_argmax([4]), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert empty.path == [] and empty.next_token == 4


def test_a_match_below_a_mismatch_does_not_count():
    tokens = torch.tensor([7, 3, 1, 4, 2, 9])
    # node 2 (token 1) equals the argmax after node 0, but node 0 itself is not the root's argmax
    verdict = verify_tree_greedy(_logits_from_argmax([3, 1, 0, 0, 0, 0, 0]), tokens, torch.tensor(PARENTS))
    assert verdict.path == [1] and verdict.next_token == 0


def test_without_replacement_probs_renormalise_after_earlier_siblings():
    dists = torch.zeros(7, 4)
    dists[0] = torch.tensor([0.5, 0.3, 0.2, 0.0])  # the root's children were drawn from this
    tokens = [0, 1, 2, 2, 3, 0]
    has = [True, False, False, False, False, False, False]
    p = without_replacement_probs(PARENTS, tokens, dists, has)
    assert torch.allclose(p[0], torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64))
    assert torch.allclose(p[1], torch.tensor([0.0, 0.6, 0.4, 0.0], dtype=torch.float64))  # 0 removed
    assert p[2].tolist() == [0, 0, 1, 0] and p[4].tolist() == [0, 0, 0, 1]  # deterministic: one-hot
    with pytest.raises(InvalidArgument, match=r"draft_tree.child_dists\[0\]"):
        without_replacement_probs([-1, -1], [0, 0], dists[:3], [True, False, False])  # 0 drawn twice


# --- losslessness: the emitted tokens follow q, over many seeded trials ---

VOCAB = 8


def _problem(seed: int):
    """q at the root and after each first token; the draft's P at the root and after each first token."""
    gen = torch.Generator().manual_seed(seed)
    q_root = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, dim=-1)
    q_next = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 1.5, dim=-1)  # [first token, V]
    noise = torch.softmax(torch.randn(VOCAB + 1, VOCAB, generator=gen) * 2, dim=-1)
    p_root = 0.5 * q_root + 0.5 * noise[0]  # a draft that agrees often, not always
    p_next = 0.5 * q_next + 0.5 * noise[1:]
    return q_root, q_next, p_root, p_next


def _run_trees(seed: int, trials: int, plain_siblings: bool = False) -> torch.Tensor:
    """Draws a tree per trial and verifies it; returns [trials, 2] (first two emitted tokens, -1 if
    the step emitted only one). The shape depends on the draws, as a dynamic tree's does: the root
    gets 3 children drawn without replacement; its most probable child gets 2 children, the next 1,
    each drawn without replacement from the draft's P after that child."""
    q_root, q_next, p_root, p_next = _problem(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    out = torch.full((trials, 2), -1, dtype=torch.long)
    for t in range(trials):
        first = torch.multinomial(p_root, 3, replacement=False, generator=gen).tolist()
        order = sorted(range(3), key=lambda i: -float(p_root[first[i]]))  # decided before their children are drawn
        parents, tokens = [-1, -1, -1], list(first)
        for node, count in ((order[0], 2), (order[1], 1)):
            for token in torch.multinomial(p_next[first[node]], count, replacement=False, generator=gen).tolist():
                parents.append(node)
                tokens.append(token)
        n = len(tokens)
        dists = torch.zeros(n + 1, VOCAB)
        has = [False] * (n + 1)
        dists[0], has[0] = p_root, True
        for node in order[:2]:
            dists[node + 1], has[node + 1] = p_next[first[node]], True
        if plain_siblings:  # the wrong rule: every sibling judged against the parent's P itself
            p = torch.stack([dists[parent + 1] for parent in parents]).double()
        else:
            p = without_replacement_probs(parents, tokens, dists, has)
        q = torch.stack([q_root] + [q_next[tok] if par == -1 else torch.full((VOCAB,), 1 / VOCAB) for tok, par in zip(tokens, parents)])
        verdict = verify_tree_rejection(q, torch.tensor(tokens), torch.tensor(parents), p,
                                        torch.rand(n, generator=gen), torch.rand(1, generator=gen))
        emitted = [tokens[i] for i in verdict.path] + [verdict.next_token]
        out[t, :min(2, len(emitted))] = torch.tensor(emitted[:2])
    return out


def _joint_pvalue(emitted: torch.Tensor, seed: int) -> float:
    """Chi-square of the first two emitted tokens (both known) against q_root(x0) q_next[x0](x1)."""
    q_root, q_next, _, _ = _problem(seed)
    both = emitted[:, 1] >= 0
    assert both.sum() > 5_000, "too few steps reached a second token to test the joint"
    first_p = _chi_square_pvalue(emitted[:, 0], q_root)
    # Given the first token x0, the second follows q_next[x0]: test each x0 with enough rows.
    pvalues = [first_p]
    for x0 in range(VOCAB):
        rows = both & (emitted[:, 0] == x0)
        if rows.sum() >= 500:
            pvalues.append(_chi_square_pvalue(emitted[rows, 1], q_next[x0]))
    return min(pvalues) * len(pvalues)  # Bonferroni: the whole test's false alarm stays FALSE_ALARM


# test-all (the suite's time): test_distribution's tree cases check trees' sampling end to end, and the
# plain-rule test below shows this check's teeth
@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_tree_rejection_sampling_follows_the_target_distribution(seed):
    emitted = _run_trees(seed, 30_000)
    assert _joint_pvalue(emitted, seed) > FALSE_ALARM


def test_distribution_test_catches_the_plain_rule_on_siblings_drawn_without_replacement():
    """Judging each sibling against the parent's P (not P without the earlier siblings) is biased."""
    emitted = _run_trees(1, 30_000, plain_siblings=True)
    assert _joint_pvalue(emitted, 1) < FALSE_ALARM


def test_deterministic_candidates_with_one_hot_p_are_lossless():
    """A draft that does not sample sends its top-k as children with one-hot p (no distribution)."""
    q_root, _, p_root, _ = _problem(3)
    top = torch.topk(p_root, 3).indices.tolist()
    trials, gen = 30_000, torch.Generator().manual_seed(4)
    dists = torch.zeros(4, VOCAB)
    p = without_replacement_probs([-1, -1, -1], top, dists, [False] * 4)
    q = q_root[None].expand(4, -1)
    firsts = torch.empty(trials, dtype=torch.long)
    for t in range(trials):
        verdict = verify_tree_rejection(q, torch.tensor(top), torch.tensor([-1, -1, -1]), p,
                                        torch.rand(3, generator=gen), torch.rand(1, generator=gen))
        firsts[t] = top[verdict.path[0]] if verdict.path else verdict.next_token
    assert _chi_square_pvalue(firsts, q_root) > FALSE_ALARM


def test_tree_rejection_is_a_pure_function_of_its_uniforms():
    q_root, q_next, p_root, _ = _problem(5)
    q = torch.stack([q_root, q_next[0], q_next[1], q_next[2], q_next[3], q_next[4], q_next[5]])
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    p = torch.softmax(torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(6)), -1).double()
    u, v = torch.rand(6, generator=torch.Generator().manual_seed(7)), torch.tensor([0.4])
    first = verify_tree_rejection(q, tokens, torch.tensor(PARENTS), p, u, v)
    assert first == verify_tree_rejection(q, tokens, torch.tensor(PARENTS), p, u, v)
    assert all(PARENTS[b] == a for a, b in zip([-1] + first.path, first.path))  # a root-to-node path
