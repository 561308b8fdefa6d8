"""The in-place KV cache layer: the same keys, values and logits as transformers' DynamicLayer."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdec.kv.buffers import MIN_CAPACITY, GrowingLayer, arena_of, full_attention, move_to_arena, new_cache
from specdec.kv.store import Sequence
from specdec.model.lm import CausalLM
from specdec.forward.tree import keep_positions
from tests import tiny


def test_appends_crops_and_replacements_match_dynamic_layer():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()
    capacities = set()
    for _ in range(300):
        roll = rng.random()
        if roll < 0.2 and plain.get_seq_length():
            drop = rng.randint(1, plain.get_seq_length())
            grow.crop(-drop)
            plain.crop(-drop)
        elif roll < 0.25 and plain.get_seq_length() > 2:  # a tree's path compaction replaces the tensors
            keep = sorted(rng.sample(range(plain.get_seq_length()), 2))
            for layer in (grow, plain):
                idx = torch.tensor(keep)
                layer.keys, layer.values = layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx)
        else:
            n = rng.choice([1, 1, 2, 5, 40])
            k, v = torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen)
            got, want = grow.update(k, v), plain.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            capacities.add(grow._buffers[0].shape[-2])
        assert grow.get_seq_length() == plain.get_seq_length()
        assert torch.equal(grow.keys, plain.keys) and torch.equal(grow.values, plain.values)
    assert min(capacities) == MIN_CAPACITY and len(capacities) > 1  # it grew, and started with spare room
    with pytest.raises(ValueError, match="negative"):
        grow.crop(1)


def test_a_reset_layer_starts_over():
    layer = GrowingLayer()
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    layer.reset()
    assert layer.get_seq_length() == 0
    keys, _ = layer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    assert keys.shape == (1, 1, 2, 2) and keys.sum() == 0


def test_appending_does_not_copy_what_is_cached():
    layer = GrowingLayer()
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    buffer = layer._buffers[0]
    layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    layer.crop(-2)
    layer.update(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    assert layer._buffers[0] is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    assert layer.keys[0, 0, :, 0].tolist() == [0, 0, 1, 1, 1, 1]


def test_model_logits_are_bit_identical_through_steps_and_rollbacks():
    target, _ = tiny.tiny_pair(seed=5)
    lm = CausalLM(target, torch.device("cpu"))
    assert all(isinstance(layer, GrowingLayer) for layer in lm.new_cache().layers)
    rng = random.Random(1)
    tokens = [rng.randrange(256) for _ in range(30)]
    ours, theirs = Sequence("a", tokens=list(tokens)), Sequence("b", tokens=list(tokens))
    theirs.cache = DynamicCache(config=target.config)
    for step in range(60):
        extra = [rng.randrange(256) for _ in range(rng.randrange(0, 6))]
        got = lm.forward(ours, extra, keep=len(extra) + 1)
        want = lm.forward(theirs, extra, keep=len(extra) + 1)
        assert torch.equal(got, want)
        length = len(ours.tokens) + rng.randrange(0, len(extra) + 1)  # accept a prefix of the extras
        if rng.random() < 0.2:
            length = rng.randrange(1, length + 1)  # roll back further
        ours.tokens = theirs.tokens = (ours.tokens + extra)[:length] + [rng.randrange(256)]
        ours.crop_cache(length)
        theirs.crop_cache(length)
        cached = ours.cached
        if step % 17 == 5 and cached > 3:  # keep a path, as tree verification does
            for seq in (ours, theirs):
                keep_positions(seq, cached - 3, [cached - 1])
            ours.tokens = theirs.tokens = ours.tokens[:cached - 3] + ours.tokens[cached - 1:]


def test_only_full_attention_layers_are_replaced():
    config = tiny.tiny_config()
    assert all(full_attention(layer) for layer in new_cache(config).layers)
    assert not full_attention(object())


def test_a_cache_is_in_its_arena_until_any_layer_leaves_it():
    """specdec/forward/batching.py copies a row in with one copy only while every layer still keeps its
    buffers in the sequence's arena; a layer that reallocated on its own must send it back to the
    layer-by-layer copy (move_to_arena)."""
    gen = torch.Generator().manual_seed(1)
    cache = DynamicCache()
    cache.layers = [GrowingLayer() for _ in range(3)]
    for layer in cache.layers:
        layer.update(torch.randn(1, 2, 5, 4, generator=gen), torch.randn(1, 2, 5, 4, generator=gen))
    assert arena_of(cache) is None
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    arena = move_to_arena(cache, 5)
    assert arena_of(cache) is arena and arena.shape == (3, 2, 2, MIN_CAPACITY, 4)
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    step = [(torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen)) for _ in cache.layers]
    for layer, (k, v) in zip(cache.layers, step):
        layer.update(k, v)  # within the room: appended into the arena in place
    assert arena_of(cache) is arena and torch.equal(arena[1, 0, :, 5], step[1][0][0, :, 0])
    moved = cache.layers[1]  # one layer's buffers move elsewhere, its length the others' (as a reallocation would)
    moved._buffers = tuple(buffer.clone() for buffer in moved._buffers)
    moved._expose()
    assert arena_of(cache) is None
    again = move_to_arena(cache, 6)  # copied back in, layer by layer
    assert arena_of(cache) is again
    cache.layers[0].update(*(torch.randn(1, 2, MIN_CAPACITY, 4, generator=gen) for _ in range(2)))  # outgrows its room
    assert arena_of(cache) is None
