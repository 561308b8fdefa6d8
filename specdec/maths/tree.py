"""Tree drafts: layout helpers and the verification maths. Pure functions over tensors, no models.

A draft tree of N nodes is given by `parents` ([N]) and `tokens` ([N]): node i continues node
parents[i], or the root when parents[i] == -1. The root is the last canonical token (the position
whose logits predict the first draft level), so with the root at index 0 and node i at index i + 1,
a tree has N + 1 positions. Parents come before their children (parents[i] < i): a topological
order, which also rules out cycles, and lets one pass over the nodes compute anything inherited.

Greedy: the target accepts the deepest node whose whole root-to-node path matches its own argmax at
each parent, then adds its argmax after that node. Every matching path spells the target's own
greedy continuation, so the output is the target's.

Sampling: recursive rejection sampling over the children of a node (SpecInfer, Miao et al. 2023;
"multi-draft" speculative sampling). At the node reached so far, with target distribution r = q:
try the children in order; child x, drawn from p_i, is accepted with probability min(1, r(x)/p_i(x))
(and the walk moves to it, with r = q at that child); on rejection r becomes norm(max(0, r - p_i)) and
the next sibling is tried; when every child is rejected (or there is none) the target's token is
drawn from r. The token that comes out follows q exactly provided each child, given everything drawn
before it, really was drawn from the p_i used here. So the p of a sibling must be the distribution it
was drawn from *conditionally on its earlier siblings*:
  - drawn WITHOUT replacement from the parent's distribution P: p_i = P with the earlier siblings'
    tokens removed, renormalised (`without_replacement_probs`). Plugging P itself into the rule
    would be wrong (tests/test_tree.py shows the bias);
  - chosen deterministically (the draft's top-k when it does not sample): p_i is one-hot at x_i,
    so the child is accepted with probability r(x_i) and removed from r on rejection.
How many children a node has may depend on anything drawn before them (its own probability, its
siblings', the budget left), never on the children's own values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from specdec.errors import InvalidArgument
from specdec.limits import MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_TOP_K
from specdec.maths.verify import sample_from

# A sparse distribution as the services exchange it: token ids and their probabilities, in the
# order drawn. Empty ids mean none: the token was chosen deterministically, so its p is one-hot.
# Every layer (drafters, coordinator, wire, target) says "none" this one way, so nothing converts.
SparseDist = tuple[Sequence[int], Sequence[float]]
EMPTY_DIST: SparseDist = ((), ())  # immutable: shared by every one-hot token


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A tree proposal, the one type the draft service builds and the target verifies: node i
    continues parents[i] (-1: the root).

    child_dists: empty, or one per position (0: the root, i + 1: node i): the sparse distribution
    that position's children were drawn from, in index order without replacement; an empty one
    means its children were chosen deterministically (one-hot p each).
    """

    parents: list[int]
    tokens: list[int]
    child_dists: list[SparseDist] = dataclasses.field(default_factory=list)

ROOT = -1


@dataclasses.dataclass(frozen=True)
class TreeVerdict:
    """The accepted root-to-node path (node indices, root excluded) and the target's token after it."""

    path: list[int]
    next_token: int


def check_parents(parents: list[int], field: str = "draft_tree.parents") -> None:
    """Raises InvalidArgument unless every parent is -1 (the root) or an earlier node."""
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise InvalidArgument(
                f"{field}[{i}]",
                f"is {parent}: a node's parent must be -1 (the root) or an earlier node, in [-1, {i}) "
                "(parents before children, which also rules out cycles)",
            )


def check_tree_bounds(budget: int, top_k: int, shape: Sequence[int], fields: Mapping[str, str], *, min_budget: int = 1,
                      check_top_k: bool = True) -> None:
    """Raises InvalidArgument unless a tree's settings are inside the contract's bounds: the one check
    the coordinator (a request's speculation fields) and the draft service (Propose's tree) share.
    `fields` names "budget", "top_k" and "shape" as the caller's message calls them; `min_budget` 0
    lets a request ask for chains; `check_top_k` False: a static shape makes top_k unused."""
    if not min_budget <= budget <= MAX_TREE_NODES:
        raise InvalidArgument(fields["budget"], f"must be in [{min_budget}, {MAX_TREE_NODES}], got {budget}")
    if check_top_k and not 1 <= top_k <= MAX_TREE_TOP_K:
        raise InvalidArgument(fields["top_k"], f"must be in [1, {MAX_TREE_TOP_K}], got {top_k}")
    if len(shape) > MAX_TREE_DEPTH:
        raise InvalidArgument(fields["shape"], f"at most {MAX_TREE_DEPTH} levels, got {len(shape)}")
    for d, width in enumerate(shape):
        if not 1 <= width <= MAX_TREE_TOP_K:
            raise InvalidArgument(f"{fields['shape']}[{d}]", f"must be in [1, {MAX_TREE_TOP_K}], got {width}")


def tree_depth(parents: Sequence[int]) -> int:
    """Levels the deepest node sits below the root: the positions its longest branch spans (a chain's
    length); 0 for no nodes. Parents come first, so one pass suffices."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 + (depth[parent] if parent != ROOT else 0))
    return max(depth, default=0)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[a, b]: position b is position a or one of its ancestors. parents [N] -> [N+1, N+1] bool.

    Position 0 is the root, position i + 1 is node i. Row a is the tree attention of position a.
    """
    n = parents.shape[0]
    mask = torch.eye(n + 1, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()):  # topological order: the parent's row is complete
        mask[i + 1] |= mask[parent + 1]
    return mask


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node (a child of the root has depth 1). [N] -> [N] int64."""
    return ancestor_mask(parents)[1:].sum(dim=-1) - 1


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for the root, node == -1)."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children(parents: list[int], position: int) -> list[int]:
    """Nodes whose parent is `position` (-1: the root), in index order (the order they are tried)."""
    return [i for i, parent in enumerate(parents) if parent == position]


def verify_tree_greedy(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> TreeVerdict:
    """The deepest node whose path matches the target's argmax, then the target's argmax after it.

    target_logits: [N+1, V] (position 0 scores the root's continuation, i + 1 node i's);
    tokens, parents: [N].
    """
    argmax = target_logits.argmax(dim=-1)  # [N+1]
    if tokens.numel() == 0:
        return TreeVerdict([], int(argmax[0]))
    edge_ok = tokens == argmax[parents + 1]  # [N]: node i is the target's choice after its parent
    anc = ancestor_mask(parents)[1:, 1:]  # [N, N] node -> its ancestors and itself
    matched = ~(anc & ~edge_ok[None, :]).any(dim=-1)  # [N]: every edge on the path matches
    score = torch.where(matched, anc.sum(dim=-1), 0)  # depth of the matched nodes
    best = int(score.argmax())  # first of the deepest (siblings with the same token tie)
    if int(score[best]) == 0:
        return TreeVerdict([], int(argmax[0]))
    return TreeVerdict(path_to(parents.tolist(), best), int(argmax[best + 1]))


def without_replacement_probs(parents: list[int], tokens: list[int], child_dists: torch.Tensor,
                              has_dist: list[bool]) -> torch.Tensor:
    """The distribution each node was drawn from. -> [N, V] float64.

    child_dists: [N+1, V], row j the distribution position j's children were drawn from, in index
    order and without replacement (has_dist[j]); a position without one chose its children
    deterministically, so each of them gets a one-hot p. Raises InvalidArgument for a node whose
    token had no probability left to be drawn with (an impossible draw: the p sent is not the p used).
    """
    n = len(tokens)
    p = torch.zeros(n, child_dists.shape[-1], dtype=torch.float64)
    removed: dict[int, list[int]] = {}  # position -> its children's tokens drawn so far
    for i, (parent, token) in enumerate(zip(parents, tokens)):
        position = parent + 1
        if has_dist[position]:
            row = child_dists[position].double().clone()
            row[removed.get(position, [])] = 0.0
            total = float(row.sum())
            if total <= 0 or row[token] <= 0:
                raise InvalidArgument(f"draft_tree.child_dists[{position}]", f"node {i} (token {token}) has probability 0 "
                                      "once its earlier siblings are drawn without replacement")
            p[i] = row / total
        else:
            p[i, token] = 1.0
        removed.setdefault(position, []).append(token)
    return p


def verify_tree_rejection(target_probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                          draft_probs: torch.Tensor, accept_uniforms: torch.Tensor, sample_uniform: torch.Tensor) -> TreeVerdict:
    """Recursive rejection sampling down the tree (see the module docstring).

    target_probs: [N+1, V] q at each position after the request's temperature / top-k / top-p;
    tokens, parents: [N]; draft_probs: [N, V] the p each node was drawn from (given its earlier
    siblings); accept_uniforms: [N] (each node is tried at most once); sample_uniform: [1].
    """
    parent_list, token_list = parents.tolist(), tokens.tolist()
    kids: list[list[int]] = [[] for _ in range(len(parent_list) + 1)]
    for i, parent in enumerate(parent_list):
        kids[parent + 1].append(i)
    path: list[int] = []
    position = 0
    residual = target_probs[0].double()  # [V]
    while True:
        for child in kids[position]:
            x = token_list[child]
            p = draft_probs[child].double()  # [V]
            r = residual / residual.sum()
            # u < r/p without dividing: a token the target gives 0 is never accepted.
            if float(accept_uniforms[child]) * float(p[x]) < float(r[x]):
                path.append(child)
                position = child + 1
                residual = target_probs[position].double()
                break
            rest = (r - p).clamp(min=0)
            # r <= p everywhere means r == p: rejection had probability 0 here; keep r for safety.
            residual = rest if float(rest.sum()) > 0 else r
        else:  # every child rejected, or a leaf: the target's own token from what is left
            token = sample_from(residual[None], sample_uniform.reshape(1))
            return TreeVerdict(path, int(token[0]))
