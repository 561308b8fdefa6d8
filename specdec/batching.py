"""Batched forwards: several sequences' pending tokens in ONE forward pass. No gRPC here.

The target verifies many sequences' proposals this way (target_service/engine.py), and the draft
drafts many sequences' next tokens this way (draft_service/batcher.py).

Layout of a batch of B rows (row i: c_i cached positions, n_i pending tokens = its unseen tokens
plus its g_i draft tokens; P = max c_i, N = max n_i):

    keys/values per layer   [B, H, P + N, D]   row i's cache right-aligned in [P - c_i, P) (left
                                                padding), its new positions at [P, P + n_i), then
                                                right padding up to P + N
    input_ids, position_ids [B, N]              row i's tokens at positions c_i, c_i + 1, ...
    attention_mask          [B, P + N]          1 exactly on row i's real positions

A row may carry a draft tree (target_service/tree.py): its nodes follow its pending tokens, sit at
position c_i + m_i - 1 + depth, and see the row's cache, its pending tokens and their own ancestors;
then the mask is given per query as [B, 1, N, P + N] instead of [B, P + N], and write_back gathers
the accepted path after the canonical positions.

Padding is masked out of every softmax (exp(-inf) = 0 exactly), positions are per row, so a row
sees exactly what it would see alone; only the floating-point order of the matmuls differs, which
tests/test_batching.py checks never flips a greedy token on the test models.

Why copy caches per step rather than keep one resident padded cache: measured with torch.profiler
on these 2 CPU cores, a SmolLM2-width model (30 layers, 3 KV heads x 64, 49,152-token head), 8 rows
of 300-370 cached tokens + 5 new each: one batched step ~230 ms against ~660 ms for the 8 rows one
by one; gathering the rows into the batch buffer and copying them back costs ~39 ms of it (17%),
about what the unbatched path spent in transformers' per-step torch.cat of every cache before its
layers appended in place (specdec/kvbuffer.py). Not enough to pay for a resident cache's bookkeeping (compaction, per-row crops, eviction and
re-fill inside a shared buffer), and per-sequence caches keep rollback, eviction, re-fill and the
unbatched path exactly as they were. The batch buffer is preallocated at P + N and held by a
`GrowingLayer`, so the forward appends in place instead of copying the cache once more.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec.hfcache import cache_kwargs, returned_cache
from specdec.kvbuffer import GrowingLayer, full_attention
from specdec.kvcache import Sequence
from specdec.lm import CausalLM
from specdec.treeforward import tree_attention
from target_service.tree import depths


def batchable(lm: CausalLM) -> bool:
    """Only full-attention caches line up position by position; sliding-window layers (Gemma 3)
    keep a trimmed window, so such models verify row by row (still one worker call per batch)."""
    return all(full_attention(layer) for layer in lm.new_cache().layers)


def _layer_kv(seq: Sequence, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if seq.cache is None or seq.cached == 0:
        return None
    cache_layer = seq.cache.layers[layer]
    return cache_layer.keys, cache_layer.values  # [1, H, c_i, D]


@torch.inference_mode()
def forward_batch(lm: CausalLM, seqs: list[Sequence], extras: list[list[int]], keeps: list[int],
                  trees: list[list[int] | None] | None = None) -> tuple[list[torch.Tensor], "BatchState"]:
    """Feeds every row's seq.tokens[seq.cached:] + extras[i] in one pass.

    trees[i]: the parents of extras[i] when row i's extras are a draft tree's nodes (None: a chain).

    Returns the float32 logits of each row's last keeps[i] positions ([keeps[i], V] each) and the
    batch's cache, from which `BatchState.write_back` gives each sequence its own cache again.
    """
    pending = [seq.tokens[seq.cached:] + list(extra) for seq, extra in zip(seqs, extras)]
    for tokens, keep in zip(pending, keeps):
        if not tokens or keep > len(tokens):
            raise ValueError(f"cannot keep {keep} logits from {len(tokens)} new positions")
    batch = len(seqs)
    past = [seq.cached if seq.cache is not None else 0 for seq in seqs]
    width_p, width_n = max(past), max(len(t) for t in pending)
    device = lm.device
    input_ids = torch.zeros(batch, width_n, dtype=torch.long)  # [B, N]; pad id 0 is masked out
    mask = torch.zeros(batch, width_p + width_n, dtype=torch.long)  # [B, P+N]
    for i, tokens in enumerate(pending):
        input_ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, width_p - past[i]:width_p + len(tokens)] = 1
    position_ids = torch.tensor(past)[:, None] + torch.arange(width_n)[None, :]  # [B, N]
    if trees is not None and any(t is not None for t in trees):
        attend = torch.zeros(batch, width_n, width_p + width_n, dtype=torch.bool)  # [B, N, P+N]
        for i, tokens in enumerate(pending):
            n = len(tokens)
            parents = torch.tensor(trees[i] if trees[i] is not None else [], dtype=torch.long)
            m = n - parents.shape[0]  # the row's pending canonical tokens, then its nodes
            attend[i, :n, width_p - past[i]:width_p] = True  # its own cache
            attend[i, :n, width_p:width_p + n] = tree_attention(0, m, parents)  # causal, then tree
            attend[i, n:, width_p + n:].fill_diagonal_(True)  # padding queries see themselves: no empty softmax
            if parents.numel():
                position_ids[i, m:n] = past[i] + m - 1 + depths(parents)
        dtype = next(lm.model.parameters()).dtype
        mask = torch.zeros(attend.shape, dtype=dtype).masked_fill(~attend, torch.finfo(dtype).min)[:, None]  # [B, 1, N, P+N]

    config = lm.model.config
    cache = DynamicCache(config=config)
    for layer_idx in range(len(cache.layers)):
        first = next((kv for seq in seqs if (kv := _layer_kv(seq, layer_idx)) is not None), None)
        if first is None:  # nothing cached in any row (all new sequences): learn the shape from the forward
            cache.layers[layer_idx] = GrowingLayer()
            continue
        _, heads, _, dim_k = first[0].shape
        dim_v = first[1].shape[-1]
        keys = first[0].new_empty(batch, heads, width_p + width_n, dim_k)  # [B, H, P+N, D]
        values = first[1].new_empty(batch, heads, width_p + width_n, dim_v)
        for i, seq in enumerate(seqs):
            # Padding is masked out, but must be finite: a masked weight of 0 times a NaN is NaN.
            keys[i, :, :width_p - past[i]] = 0
            values[i, :, :width_p - past[i]] = 0
            kv = _layer_kv(seq, layer_idx)
            if kv is not None:
                keys[i, :, width_p - past[i]:width_p] = kv[0][0, :, :past[i]]
                values[i, :, width_p - past[i]:width_p] = kv[1][0, :, :past[i]]
        cache.layers[layer_idx] = GrowingLayer.holding(keys, values, width_p)  # the forward appends in place

    out = lm.model(
        input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=position_ids.to(device),
        **cache_kwargs(lm.model, cache), use_cache=True,
        logits_to_keep=width_n,  # only the new positions; each row's own last keeps[i] are picked below
    )
    logits = [out.logits[i, len(tokens) - keep:len(tokens)].float().cpu() for i, (tokens, keep) in enumerate(zip(pending, keeps))]
    to_vocab = getattr(lm.model, "to_target_logits", None)  # a pruned draft scores only its kept ids
    if to_vocab is not None:
        logits = [to_vocab(rows) for rows in logits]
    return logits, BatchState(returned_cache(out), past, [len(t) for t in pending], width_p)


class BatchState:
    """The batch's cache after the forward, until each row takes its part back."""

    def __init__(self, cache: DynamicCache, past: list[int], new: list[int], width_p: int):
        self.cache, self.past, self.new, self.width_p = cache, past, new, width_p

    def write_back(self, i: int, seq: Sequence, lm: CausalLM, length: int, extra: list[int] = ()) -> None:
        """Gives row i's sequence its own cache over its first `length` positions (the accepted ones),
        followed by the row's positions `extra` (a tree's accepted path, gathered by index).

        Cloned, not viewed: a view would pin the whole batch buffer for as long as any of its rows
        stays idle, so memory would no longer be bounded by the sequences' own lengths.
        """
        start = self.width_p - self.past[i]
        length = min(length, self.past[i] + self.new[i])
        if length <= 0 and not extra:
            seq.cache, seq.cached = None, 0
            return
        index = start + torch.cat([torch.arange(max(length, 0)), torch.tensor(list(extra), dtype=torch.long)])
        own = lm.new_cache()
        for layer_idx, layer in enumerate(self.cache.layers):
            idx = index.to(layer.keys.device)
            # update() copies into the new cache's own layer, whatever cache class lm uses.
            own.layers[layer_idx].update(layer.keys[i:i + 1].index_select(-2, idx),  # [1, H, length + len(extra), D]
                                         layer.values[i:i + 1].index_select(-2, idx))
        seq.cache = own
        seq.cached = max(length, 0) + len(extra)
