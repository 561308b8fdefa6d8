"""Drafting a tree of candidates with a small causal LM: one draft forward per tree level. No gRPC.

Each level feeds the nodes whose children are wanted next in ONE pass, with a tree attention mask
(each node sees the canonical tokens and its own ancestors, at position L - 1 + depth), so a node's
logits are exactly those of its root-to-node path fed as a chain. Afterwards the draft's cache is
cropped back to the canonical tokens: the target decides which path survives.

Shapes:
- dynamic (EAGLE-2, Li et al. 2024): at each level the `top_k` newest nodes with the highest
  cumulative draft probability are expanded. Greedy: each gets its `top_k` most probable tokens,
  and the final tree is the `budget` nodes of highest cumulative probability (a node's is never
  above its parent's, so the choice keeps ancestors). Sampling: the node of rank r gets
  max(1, top_k // (r + 1)) children drawn WITHOUT replacement from the draft's top-k truncated
  distribution, until the budget is spent; every drawn node is sent (re-ranking drawn nodes by
  their own values would bias them; see specdec/maths/tree.py for the rule this keeps exact).
- static: every node at depth d gets shape[d] children (the most probable, or drawn), level by
  level, until the budget is spent.
In both, how many children a node gets is decided before they are drawn, from what was drawn
earlier only: that is what keeps the target's recursive rejection sampling lossless.

The choosing (ranking, budget, draws) is TreeBuilder's alone; the forwards are three methods a
drafter with another model overrides (`_root`, `_forward_level`, `_close`): the feature draft
(draft_service/drafters/feature.py) builds the same trees over its own (feature, token) pairs.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from specdec.limits import MAX_TREE_TOP_K
from specdec.kv.store import Sequence
from specdec.calls.request import ProposeCall
from specdec.maths.sampling import truncated_probs
from specdec.forward.tree import forward_masked
from specdec.maths.tree import EMPTY_DIST, DraftTree, SparseDist


@dataclasses.dataclass(frozen=True)
class TreeDraft(DraftTree):
    """The one tree type (specdec/maths/tree.py: DraftTree) with the draft's compute time for it."""

    compute_seconds: float = 0.0


@dataclasses.dataclass
class _Node:
    parent: int  # index in the node list; -1 is the root
    token: int
    logp: float  # cumulative log probability under the draft (what ranks nodes)
    depth: int
    cache_pos: int = -1  # where its key/value sit in the draft's cache, once fed


class TreeBuilder:
    """Builds one tree over a sequence whose pending canonical tokens are not yet fed: shaped by
    `call.tree`, at most `call.draft_length` deep, drawn at `call.temperature` (0: the most
    probable children)."""

    def __init__(self, lm, seq: Sequence, call: ProposeCall, dist_top_k: int):
        self.lm, self.seq, self.call, self.dist_top_k = lm, seq, call, dist_top_k
        self.tree = call.tree  # the shape: budget, top_k, shape
        self.generator = torch.Generator().manual_seed(call.seed)
        self.nodes: list[_Node] = []
        self.logits: dict[int, torch.Tensor] = {}  # position (-1: root) -> draft logits [V]
        self.child_dists: dict[int, SparseDist] = {}  # position -> drawn from
        self.length = len(seq.tokens)
        self.base = 0  # cache entries every node sees (the canonical ones), known after _root

    @property
    def sampling(self) -> bool:
        return self.call.temperature > 0

    def build(self) -> TreeDraft:
        try:
            self.logits[-1] = self._root()
            self.base = self.seq.cached  # what every node sees: the cache before the tree
            frontier, depth = [(-1, self._width(0, 0))], 0
            while True:
                new = []
                for position, count in frontier:
                    new += self._expand(position, min(count, self._room_for()))
                depth += 1
                if depth >= self.call.draft_length or not new or not self._room():
                    break
                frontier = self._next_frontier(new, depth)
                if not frontier:
                    break
                self._feed([position for position, _ in frontier])
            return self._result()
        finally:
            self._close()

    # --- the draft's forwards (a drafter with another model overrides these three) ---

    def _root(self) -> torch.Tensor:
        """Feeds the catch-up; returns the logits [V] after the last canonical token."""
        return self.lm.forward(self.seq, keep=1)[0]  # the cache now covers [0, L)

    def _forward_level(self, ids: list[int], positions: list[int], attend: torch.Tensor) -> torch.Tensor:
        """One forward over the nodes `ids` (their keys and values join the cache, seq.cached grows
        by len(ids)); attend [len(ids), seq.cached + len(ids)]. Returns their logits [len(ids), V]."""
        tokens = [self.nodes[i].token for i in ids]
        return forward_masked(self.lm, self.seq, tokens, positions, attend, keep=len(ids))

    def _close(self) -> None:
        self.seq.crop_cache(self.length)  # the tree's entries go; the canonical tokens stay

    # --- shape policy ---

    def _room(self) -> bool:
        return not self.sampling and not self.tree.shape or len(self.nodes) < self.tree.budget

    def _room_for(self) -> int:
        """Children still allowed. Greedy dynamic trees over-draft and keep the best `budget` at the end."""
        if not self.sampling and not self.tree.shape:
            return MAX_TREE_TOP_K
        return self.tree.budget - len(self.nodes)

    def _width(self, depth: int, rank: int) -> int:
        s = self.tree
        if s.shape:
            return s.shape[depth] if depth < len(s.shape) else 0
        return max(1, s.top_k // (rank + 1)) if self.sampling else s.top_k

    def _next_frontier(self, new: list[int], depth: int) -> list[tuple[int, int]]:
        """(node, children) to expand at the next level, decided before any of them is drawn."""
        s = self.tree
        if s.shape:
            if depth >= len(s.shape):
                return []
            width, room = s.shape[depth], s.budget - len(self.nodes)
            chosen = new[:math.ceil(room / width)] if room > 0 else []
            return [(i, width) for i in chosen]
        ranked = sorted(new, key=lambda i: -self.nodes[i].logp)[:s.top_k]
        if not self.sampling:
            # A child's cumulative probability is at most its parent's: once no candidate beats the
            # budget-th best node so far, deeper levels cannot change the final tree.
            best = sorted((n.logp for n in self.nodes), reverse=True)
            if len(best) >= s.budget:
                ranked = [i for i in ranked if self.nodes[i].logp > best[s.budget - 1]]
        return [(i, self._width(depth, rank)) for rank, i in enumerate(ranked)]

    # --- drafting ---

    def _expand(self, position: int, count: int) -> list[int]:
        """Adds `count` children of `position` (most probable, or drawn without replacement)."""
        if count <= 0:
            return []
        logits = self.logits[position]
        parent_logp = self.nodes[position].logp if position >= 0 else 0.0
        depth = self.nodes[position].depth + 1 if position >= 0 else 1
        if self.sampling:
            ids, probs = truncated_probs(logits, self.call.temperature, self.dist_top_k)
            self.child_dists[position] = (ids.tolist(), probs.tolist())
            weights = probs.double().clone()
            picks = []
            for _ in range(min(count, int((weights > 0).sum()))):
                choice = int(torch.multinomial(weights, 1, generator=self.generator))
                picks.append((int(ids[choice]), float(probs[choice])))
                weights[choice] = 0.0
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            top = torch.topk(probs, min(count, probs.shape[-1]))
            picks = [(int(t), float(p)) for t, p in zip(top.indices, top.values) if p > 0]
        added = []
        for token, prob in picks:
            self.nodes.append(_Node(position, token, parent_logp + math.log(max(prob, 1e-30)), depth))
            added.append(len(self.nodes) - 1)
        return added

    def _feed(self, ids: list[int]) -> None:
        """One draft forward over these nodes, each seeing the canonical tokens and its ancestors."""
        if not ids:
            return
        cached = self.seq.cached
        attend = torch.zeros(len(ids), cached + len(ids), dtype=torch.bool)
        attend[:, :self.base] = True
        for row, i in enumerate(ids):
            self.nodes[i].cache_pos = cached + row
            node = self.nodes[i]
            while node is not None:
                attend[row, node.cache_pos] = True  # ancestors were fed at earlier levels
                node = self.nodes[node.parent] if node.parent >= 0 else None
        positions = [self.base - 1 + self.nodes[i].depth for i in ids]  # a chain's positions along the path
        logits = self._forward_level(ids, positions, attend)
        for row, i in enumerate(ids):
            self.logits[i] = logits[row]

    def _result(self) -> TreeDraft:
        keep = list(range(len(self.nodes)))
        if not self.sampling and not self.tree.shape and len(keep) > self.tree.budget:
            # Best `budget` by cumulative probability; ties go to the shallower, earlier node, so
            # a kept node's parent (never less probable) is kept too.
            ranked = sorted(keep, key=lambda i: (-self.nodes[i].logp, self.nodes[i].depth, i))
            chosen: set[int] = set()
            for i in ranked:
                if len(chosen) == self.tree.budget:
                    break
                if self.nodes[i].parent < 0 or self.nodes[i].parent in chosen:
                    chosen.add(i)
            keep = sorted(chosen)  # creation order: parents before children
        index = {old: new for new, old in enumerate(keep)}
        parents = [index[self.nodes[i].parent] if self.nodes[i].parent >= 0 else -1 for i in keep]
        tokens = [self.nodes[i].token for i in keep]
        dists: list[SparseDist] = []
        if self.sampling:
            dists = [self.child_dists.get(-1, EMPTY_DIST)] + [self.child_dists.get(i, EMPTY_DIST) for i in keep]
            for j in range(len(keep)):
                if j not in parents:
                    dists[j + 1] = EMPTY_DIST  # drawn from, but no child was kept: nothing to send
        return TreeDraft(parents, tokens, dists)
