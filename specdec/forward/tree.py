"""One forward pass over a token tree: tree attention mask, positions by depth, and keeping one path.

Shared by the target (verifying a draft tree) and the draft (expanding one tree level per pass).
Layout of a pass over a sequence with c cached positions, m pending canonical tokens (the last of
them is the tree's root, at position L - 1 with L = c + m) and N tree nodes:

    input_ids      [1, m + N]            pending tokens, then the nodes in index order
    position_ids   [1, m + N]            c .. L-1, then L - 1 + depth(node)
    attention      [1, 1, m + N, c + m + N]  pending rows causal; a node row sees the cached and
                                         pending positions and its own ancestors (itself included)

So a node's key and value are exactly what they would be had its root-to-node path been fed as a
chain; keeping the accepted path's entries (gathered by index) leaves the cache a chain would leave.
Only caches whose layers line up position by position (full attention: `LanguageModel.full_attention_cache`)
can be gathered; `supports_trees` says whether a model has them.
"""

from __future__ import annotations

import torch

from specdec.model.hfcache import cache_kwargs, returned_cache
from specdec.kv.store import Sequence
from specdec.model.interface import LanguageModel
from specdec.maths.tree import ancestor_mask


def supports_trees(lm: LanguageModel) -> bool:
    """Sliding-window layers (Gemma 3) keep a trimmed window that a gather by index would break;
    fixed-shape passes (specdec/model/gpu/static.py) gather in their own slots, and say so."""
    return lm.full_attention_cache()


def tree_attention(cached: int, pending: int, parents: torch.Tensor) -> torch.Tensor:
    """Bool [pending + N, cached + pending + N]: who each new position attends to.

    parents: [N] (-1: a child of the root, the last pending token).
    """
    n = parents.shape[0]
    total = cached + pending + n
    attend = torch.zeros(pending + n, total, dtype=torch.bool)
    attend[:, :cached] = True
    attend[:pending, cached:cached + pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
    attend[pending:, cached:cached + pending] = True  # every node sees the whole canonical prefix
    attend[pending:, cached + pending:] = ancestor_mask(parents)[1:, 1:]
    return attend


@torch.inference_mode()
def forward_masked(lm: LanguageModel, seq: Sequence, tokens: list[int], positions: list[int], attend: torch.Tensor,
                   keep: int) -> torch.Tensor:
    """Feeds `tokens` after seq's cached positions with explicit positions and attention.

    attend: [len(tokens), seq.cached + len(tokens)] bool. The tokens enter the cache (seq.cached
    grows by len(tokens)); returns float32 logits of the last `keep` tokens, [keep, V].
    """
    if seq.cache is None:
        seq.cache = lm.new_cache()
    model = lm.model
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(attend.shape, dtype=dtype).masked_fill(~attend, torch.finfo(dtype).min)
    out = model(
        input_ids=torch.tensor([tokens], dtype=torch.long, device=lm.device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=lm.device),
        attention_mask=mask[None, None].to(lm.device),  # [1, 1, n, cached + n]: used as given
        **cache_kwargs(model, seq.cache), use_cache=True, logits_to_keep=keep,
    )
    seq.cache = returned_cache(out)
    seq.cached += len(tokens)
    return lm.to_target_logits(out.logits[0, -keep:].float().cpu())  # a pruned draft's head covers part of the vocabulary


def forward_tree(lm: LanguageModel, seq: Sequence, tree_tokens: list[int], parents: list[int]) -> torch.Tensor:
    """Feeds the pending canonical tokens and the whole tree in one pass.

    Returns the logits of the root and of every node, [N + 1, V]. Afterwards the cache holds the
    canonical tokens (len(seq.tokens) positions) followed by the N nodes; `keep_positions` trims it
    to the canonical tokens and the accepted path.
    """
    if lm.fixed_shape:
        return lm.forward_tree(seq, list(tree_tokens), list(parents))
    cached, length = seq.cached, len(seq.tokens)
    pending = seq.tokens[cached:]
    if not pending:
        raise ValueError("nothing pending: the store keeps at least the root token uncached")
    parent_t = torch.tensor(parents, dtype=torch.long)
    depth = ancestor_mask(parent_t)[1:].sum(dim=-1) - 1  # [N]
    positions = list(range(cached, length)) + (length - 1 + depth).tolist()
    attend = tree_attention(cached, len(pending), parent_t)
    return forward_masked(lm, seq, pending + list(tree_tokens), positions, attend, keep=len(tree_tokens) + 1)


def keep_positions(seq: Sequence, prefix: int, extra: list[int]) -> None:
    """Keeps cache positions [0, prefix) followed by the positions `extra` (in that order)."""
    if hasattr(seq.cache, "keep"):  # a slot of the static cache (specdec/model/gpu/static.py)
        seq.cache.keep(prefix, list(extra))
        seq.cached = prefix + len(extra)
        return
    index = torch.cat([torch.arange(prefix), torch.tensor(extra, dtype=torch.long)])
    for layer in seq.cache.layers:
        idx = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
    seq.cached = prefix + len(extra)
