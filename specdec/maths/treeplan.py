"""One tree call's plan and verdict, between the engine's forward pass and tree.py's maths. No gRPC.

The plan is what the forward pass feeds (the tree, or for a model that cannot verify trees the
chain of first children) with the p each node was drawn from; the verdict turns the pass's logits
into the accepted path (in the caller's node numbering) and the target's own token.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.maths.sampling import SamplingConfig, generator_for, target_probs
from specdec.maths.tree import verify_tree_greedy, verify_tree_rejection, without_replacement_probs


@dataclasses.dataclass(frozen=True)
class TreePlan:
    tokens: list[int]  # fed after the canonical tokens, in index order
    parents: list[int]
    nodes: list[int]  # plan node -> the caller's node index
    p: torch.Tensor | None  # [N, V] the distribution each node was drawn from; None when greedy


def draft_probs(parents: list[int], tokens: list[int], child_dists, sampling: SamplingConfig, vocab: int) -> torch.Tensor | None:
    """[N, V] p of each node (siblings without replacement, one-hot where a position sent none)."""
    if sampling.greedy:
        return None
    positions = len(tokens) + 1
    dists = torch.zeros(positions, vocab)
    has = [False] * positions
    for j, (ids, probs) in enumerate(child_dists):
        if ids:
            dists[j, torch.tensor(ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float32)
            has[j] = True
    return without_replacement_probs(list(parents), list(tokens), dists, has)


def plan_tree(tree, sampling: SamplingConfig, vocab: int, trees_supported: bool) -> TreePlan:
    """The whole tree, or the chain of first children (each drawn from its parent's P itself, so an
    ordinary lossless chain) for a model whose cache cannot keep a path gathered by index."""
    parents, tokens = list(tree.parents), list(tree.tokens)
    p = draft_probs(parents, tokens, tree.child_dists, sampling, vocab)
    if trees_supported:
        return TreePlan(tokens, parents, list(range(len(tokens))), p)
    nodes, parent = [], -1
    while (kids := [i for i, par in enumerate(parents) if par == parent]):
        nodes.append(kids[0])
        parent = kids[0]
    return TreePlan([tokens[i] for i in nodes], list(range(-1, len(nodes) - 1)), nodes, p[nodes] if p is not None else None)


def tree_verdict(plan: TreePlan, sampling: SamplingConfig, logits: torch.Tensor, position: int) -> tuple[list[int], int]:
    """(accepted plan nodes, next token) from the logits of the root and every node ([N+1, V]).

    `position` is the root's canonical length: the uniforms are keyed by it, as a chain's are.
    """
    token_t = torch.tensor(plan.tokens, dtype=torch.long)
    parent_t = torch.tensor(plan.parents, dtype=torch.long)
    if sampling.greedy:
        verdict = verify_tree_greedy(logits, token_t, parent_t)
    else:
        q = target_probs(logits, sampling)  # [N+1, V]
        gen = generator_for(sampling.seed, position, "target")
        accept_u, sample_u = torch.rand(len(plan.tokens), generator=gen), torch.rand(1, generator=gen)
        verdict = verify_tree_rejection(q, token_t, parent_t, plan.p.to(q.device), accept_u, sample_u)
    return verdict.path, verdict.next_token
