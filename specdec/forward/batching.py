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

A row may carry a draft tree (specdec/maths/tree.py): its nodes follow its pending tokens, sit at
position c_i + m_i - 1 + depth, and see the row's cache, its pending tokens and their own ancestors;
then the mask is given per query as [B, 1, N, P + N] instead of [B, P + N], and write_back gathers
the accepted path after the canonical positions.

Padding is masked out of every softmax (exp(-inf) = 0 exactly), positions are per row, so a row
sees exactly what it would see alone; only the floating-point order of the matmuls differs, which
tests/test_batching.py checks never flips a greedy token on the test models.

Why copy caches per step rather than keep one resident padded cache: per-sequence caches keep
rollback, eviction, re-fill and the unbatched path exactly as they were, and a resident cache would
need compaction, per-row crops and eviction inside a shared buffer. What made the copies expensive
was their number, not their bytes: layer by layer, a few rows of a 30-layer model meant thousands
of small tensor copies a step, as costly as the batched forward itself. So a sequence
whose layers share one shape keeps all of them in one tensor,
its arena [L, 2, H, capacity, D] (specdec/kv/buffers.py), the batch is one tensor too, and a row
goes in with one copy and comes back with one copy of its new positions only (its arena still
holds the rest). Models whose layers differ in shape copy layer by layer, as before.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec.model.hfcache import cache_kwargs, returned_cache
from specdec.kv.buffers import GrowingLayer, arena_of, arena_shape, bind_arena, move_to_arena, new_arena, set_arena_length
from specdec.kv.store import Sequence
from specdec.model.cpu import stack
from specdec.model.interface import LanguageModel
from specdec.forward.tree import tree_attention
from specdec.maths.tree import depths


def batchable(lm: LanguageModel) -> bool:
    """Only full-attention caches line up position by position; sliding-window layers (Gemma 3)
    keep a trimmed window, so such models verify row by row (still one worker call per batch).
    Fixed-shape passes (specdec/model/gpu/static.py) batch anything, and say so."""
    return lm.full_attention_cache()


def _layer_kv(seq: Sequence, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if seq.cache is None or seq.cached == 0:
        return None
    cache_layer = seq.cache.layers[layer]
    return cache_layer.keys, cache_layer.values  # [1, H, c_i, D]


# Padded key rows (rows x longest cache - the keys the rows really hold) one pass may carry before a
# row goes to a pass of its own. Every row of a batch is padded to the longest cache, and on a CPU a
# padded key costs as much in copies and attention as a real one: beside short rows, one row with
# thousands of cached positions made everybody's step many times slower than two passes apart
# (benchmarks/results/chunked-prefill/NOTES.md, "Long prompts without victims"). A pass of its own costs one more read of
# the weights, which this many padded keys outweigh.
PAD_KEYS = 2048


def pad_groups(cached: list[int], budget: int = PAD_KEYS) -> list[list[int]]:
    """Indices of `cached` (each row's cache length) split into passes whose padding stays within
    `budget` key rows: by length, shortest first, so rows of like length share a pass."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(cached)), key=cached.__getitem__):
        if groups and (len(groups[-1]) + 1) * cached[i] - (total + cached[i]) <= budget:
            groups[-1].append(i)
            total += cached[i]
        else:
            groups.append([i])
            total = cached[i]
    return groups


def pass_groups(lm: LanguageModel, cached: list[int]) -> list[list[int]]:
    """The passes a batch of rows with these cache lengths runs as (indices): fixed-shape passes
    (specdec/model/gpu/static.py) and the compact model's one-call stack (specdec/model/cpu/stack.py) pad
    nothing and take them all; otherwise pad_groups."""
    if lm.fixed_shape or stack.applies(lm):
        return [list(range(len(cached)))] if cached else []
    return pad_groups(cached)


@torch.inference_mode()
def forward_batch(lm: LanguageModel, seqs: list[Sequence], extras: list[list[int]], keeps: list[int],
                  trees: list[list[int] | None] | None = None, on_device: bool = False) -> tuple[list[torch.Tensor], "BatchState"]:
    """Feeds every row's seq.tokens[seq.cached:] + extras[i] in one pass.

    trees[i]: the parents of extras[i] when row i's extras are a draft tree's nodes (None: a chain).

    Returns the float32 logits of each row's last keeps[i] positions ([keeps[i], V] each; on the
    CPU unless `on_device`, where a fixed-shape GPU pass leaves them on the GPU for a verdict there)
    and the batch's cache, from which `BatchState.write_back` gives each sequence its own cache again.
    """
    if lm.fixed_shape:
        return lm.forward_batch(seqs, extras, keeps, trees, on_device=on_device)
    pending = [seq.tokens[seq.cached:] + list(extra) for seq, extra in zip(seqs, extras)]
    for tokens, keep in zip(pending, keeps):
        if not tokens or keep > len(tokens):
            raise ValueError(f"cannot keep {keep} logits from {len(tokens)} new positions")
    if trees is None or all(t is None for t in trees):  # chains: each row appends to its own cache
        logits = stack.forward_rows(lm, seqs, pending, keeps)
        if logits is not None:
            return logits, stack.DirectBatch()
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
        mask = _tree_mask(lm, pending, trees, past, width_p, width_n, position_ids)

    config = lm.model.config
    cache = DynamicCache(config=config)
    block, arenas = _arena_batch(lm, seqs, past, width_p, width_n)
    if block is not None:  # every layer of every row in one tensor: a copy per row, not per row and layer
        for layer_idx in range(len(cache.layers)):
            cache.layers[layer_idx] = GrowingLayer.holding(block[layer_idx, 0], block[layer_idx, 1], width_p)
    for layer_idx in range(len(cache.layers) if block is None else 0):
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
    logits = [out.logits[i, len(tokens) - keep:len(tokens)].float() for i, (tokens, keep) in enumerate(zip(pending, keeps))]
    if not on_device:
        logits = [rows.cpu() for rows in logits]
    logits = [lm.to_target_logits(rows) for rows in logits]  # a pruned draft scores only its kept ids
    return logits, BatchState(returned_cache(out), past, [len(t) for t in pending], width_p, block, arenas)


def _tree_mask(lm: LanguageModel, pending: list[list[int]], trees: list[list[int] | None], past: list[int], width_p: int,
               width_n: int, position_ids: torch.Tensor) -> torch.Tensor:
    """The [B, 1, N, P+N] additive mask of a batch with draft trees (module docstring), setting the
    tree nodes' positions in position_ids (in place) to their depth past the row's pending tokens."""
    batch = len(pending)
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
    return torch.zeros(attend.shape, dtype=dtype).masked_fill(~attend, torch.finfo(dtype).min)[:, None]


def _arena_batch(lm: LanguageModel, seqs: list[Sequence], past: list[int], width_p: int,
                 width_n: int) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The batch's keys and values as ONE tensor [L, 2, B, H, P + N, D], each row's cache copied in
    from its sequence's arena (specdec/kv/buffers.py) with one copy, and each row's arena (None for a
    row with nothing cached); (None, []) when some row's layers differ in shape (then the caller
    fills the batch layer by layer) or no row has a cache yet.

    Why: with the small-M kernel, copying the rows' caches in layer by layer and back out again
    cost about as much as the batched model forward itself, nearly all of it the dispatch of
    thousands of small tensor copies. The tensor lives in memory kept from the last
    batch (_scratch)."""
    shapes = {arena_shape(seq.cache) for seq, c in zip(seqs, past) if c}
    if len(shapes) != 1 or None in shapes:
        return None, []
    layers, heads, dim = shapes.pop()
    arenas = []
    for seq, c in zip(seqs, past):
        arena = arena_of(seq.cache) if c else None
        arenas.append(move_to_arena(seq.cache, c) if c and arena is None else arena)
    like = next(a for a in arenas if a is not None)
    block = _scratch(lm, like, (layers, 2, len(seqs), heads, width_p + width_n, dim))
    for i, (arena, c) in enumerate(zip(arenas, past)):
        # Padding is masked out, but must be finite: a masked weight of 0 times a NaN is NaN.
        if c < width_p:
            block[:, :, i, :, :width_p - c].zero_()
        if c:
            block[:, :, i, :, width_p - c:width_p] = arena[:, :, :, :c]
    return block, arenas


# Batch caches up to this size stay allocated for the next batch (_scratch); larger ones are freed.
SCRATCH_KEEP_BYTES = 1 << 30


def _scratch(lm: LanguageModel, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised tensor of `shape` in memory that the model's previous batch used.

    Why: a batch cache is one large allocation, which glibc serves with a fresh mmap and returns
    on free, so every step paid a page fault per page on first touch: building the batch in fresh
    memory cost several times what it costs in reused memory. The batch's cache is done with once every row has its own
    back (BatchState.write_back), before the model's next batched forward on the same worker."""
    numel = 1
    for size in shape:
        numel *= size
    held = lm.batch_scratch  # per model: each model runs on its own worker thread
    if held is not None and held.numel() >= numel and held.dtype == like.dtype and held.device == like.device:
        return held[:numel].view(shape)
    # A quarter more than asked: the rows grow a few positions a step, so the next steps fit too.
    buffer = like.new_empty(numel + numel // 4)
    lm.batch_scratch = buffer if buffer.numel() * buffer.element_size() <= SCRATCH_KEEP_BYTES else None
    return buffer[:numel].view(shape)


class BatchState:
    """The batch's cache after the forward, until each row takes its part back."""

    def __init__(self, cache: DynamicCache, past: list[int], new: list[int], width_p: int, block: torch.Tensor | None = None,
                 arenas: list[torch.Tensor | None] = ()):
        self.cache, self.past, self.new, self.width_p = cache, past, new, width_p
        # Each row's arena, bound to its sequence's cache just before the forward: write_back runs
        # right after it on the same worker, so nothing can have moved them since.
        self.arenas = list(arenas)
        # The [L, 2, B, H, P + N, D] tensor the forward appended into, if the batch was built as one
        # (_arena_batch) and every layer still holds it (the forward had the room it needed).
        self.block = block if block is not None and all(
            layer.keys.data_ptr() == block[index, 0].data_ptr() and layer.values.data_ptr() == block[index, 1].data_ptr()
            for index, layer in enumerate(self.cache.layers)) else None

    @torch.inference_mode()  # the arenas are inference tensors (made in forward_batch): appended to in place
    def write_back(self, i: int, seq: Sequence, lm: LanguageModel, length: int, extra: list[int] = ()) -> None:
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
        if self.block is not None:
            self._write_back_arena(i, seq, lm, max(length, 0), list(extra))
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

    def _write_back_arena(self, i: int, seq: Sequence, lm: LanguageModel, length: int, extra: list[int]) -> None:
        """write_back from a batch built as one tensor: the sequence's own arena still holds its first
        past[i] positions (the forward only read them), so only the row's new accepted positions
        (and a tree's path) are copied over, for all layers at once."""
        block, c, start = self.block, self.past[i], self.width_p - self.past[i]
        keep = min(length, c)  # positions the sequence's arena holds already
        total = length + len(extra)
        arena = self.arenas[i]  # bound to seq.cache by _arena_batch just before the forward
        rebind = arena is None or arena.shape[-2] < total
        if rebind:  # a new row (nothing kept), or one that outgrew its arena
            old = arena
            layers, _, _, heads, _, dim = block.shape
            arena = new_arena(block, layers, heads, dim, total, old.shape[-2] if old is not None else 0)
            if keep:
                arena[:, :, :, :keep] = old[:, :, :, :keep]
        if length > keep:
            arena[:, :, :, keep:length] = block[:, :, i, :, start + keep:start + length]
        if extra:
            index = torch.tensor([start + position for position in extra], dtype=torch.long, device=block.device)
            arena[:, :, :, length:total] = block[:, :, i].index_select(-2, index)
        if seq.cache is None or not c:
            seq.cache = lm.new_cache()
        if rebind:
            bind_arena(seq.cache, arena, total)
        else:  # the layers keep their buffers in this arena already: only their length moves
            set_arena_length(seq.cache, total)
        seq.cached = total
