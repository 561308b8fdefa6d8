"""A KV cache layer that appends in place, so a decoding step does not copy the whole cache.

transformers' DynamicLayer appends a step's keys and values with torch.cat, which copies every
cached position of every layer on every forward: O(context) bytes per step, on top of the weights.
The copy grows with the context, so the in-place cache gains nothing at short contexts and more
the longer the context grows (`benchmarks/kv_append.py` measures it). Serving engines
preallocate KV memory for the same reason (vLLM's paged
blocks, llama.cpp's fixed-size cache).

`GrowingLayer` keeps keys and values in buffers with spare room, doubling when full (amortised
O(1) per appended position, for at most about twice the memory of the filled part), and exposes
`keys`/`values` as views of the filled part, so attention reads exactly what DynamicLayer would
hand it: the logits are bit-identical (tests/test_kv_buffers.py). Rollback (`crop`) only moves the
end. Code that replaces `keys`/`values` outright (a tree's path compaction, transformers' beam
reordering) is honoured: the next append adopts whatever the layer then holds.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64  # positions


def room(needed: int, held: int = 0) -> int:
    """Positions to allocate for `needed`, growing from `held`: half again the need (a prefill or a
    re-filled sequence goes on appending), at least double the old room (amortised O(1) per position)."""
    return max(MIN_CAPACITY, needed + needed // 2, 2 * held)


class GrowingLayer(DynamicLayer):
    """A full-attention layer whose keys/values [B, H, T, D] are views into buffers [B, H, capacity, D]."""

    def __init__(self, *args, **kwargs):
        self._stale = False  # advance() moved the end: keys/values are made on the next read (before super's setter runs)
        super().__init__(*args, **kwargs)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys/values this layer exposed

    # keys/values are views made when read, not each time the end moves: the one-call stack
    # (specdec/model/cpu/stack.py) appends to every layer of every row in a pass and reads none of
    # them back, and two views a layer a row were ~5% of an 8-row pass's time.
    @property
    def keys(self) -> torch.Tensor | None:
        if self._stale:
            self._expose()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys, self._stale = value, False

    @property
    def values(self) -> torch.Tensor | None:
        if self._stale:
            self._expose()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values, self._stale = value, False
        self._length = 0
        self._arena: torch.Tensor | None = None  # the tensor _buffers are views of (bind_arena), if any

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> GrowingLayer:
        """A layer over buffers the caller filled: their first `length` positions are the cache, the
        rest is room to append into (a batch's padded cache, specdec/forward/batching.py)."""
        layer = cls()
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        layer._buffers, layer._length = (keys, values), length
        layer._expose()
        return layer

    def _owned(self) -> bool:
        """Are keys/values still the views this layer made? (False after an outside replacement.)
        Stale ones are: a replacement would have gone through the setters, which clear the flag."""
        return self._stale or (self._views is not None and self._keys is self._views[0] and self._values is self._views[1])

    def _expose(self) -> None:
        k, v = self._buffers
        self._keys, self._values = k[..., :self._length, :], v[..., :self._length, :]
        self._views, self._stale = (self._keys, self._values), False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:  # by hand: lazy_initialization's signature differs across transformers 5.x
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys, self.values = key_states.new_zeros(0), value_states.new_zeros(0)
            self.is_initialized = True
        if not self._owned():  # first append, or keys/values were replaced: adopt them as the contents
            self._length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            held = (self.keys, self.values) if self._length else None
            self._buffers = None
            self._reserve(self._length + key_states.shape[-2], key_states, value_states, held)
        else:
            self._reserve(self._length + key_states.shape[-2], key_states, value_states, self._buffers)
        start, end = self._length, self._length + key_states.shape[-2]
        k, v = self._buffers
        k[..., start:end, :] = key_states
        v[..., start:end, :] = value_states
        self._length = end
        self._expose()
        return self.keys, self.values

    def open_rows(self, count: int, template: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key and value buffers [1, H, capacity, D] with room for `count` more positions, for a
        caller that writes them itself (specdec/model/cpu/stack.py, in C); `advance(count)` then makes
        them part of the cache. `template` [1, H, 0, D] gives the shape and dtype of a first append.
        None where the layer holds keys it did not make (someone replaced them): that caller then
        goes through `update`, which adopts them."""
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = template.dtype, template.device, True
            self.keys, self.values = template.new_zeros(0), template.new_zeros(0)
            self._length, self._buffers, self._views = 0, None, None
        elif not self._owned():
            return None
        self._reserve(self._length + count, template, template, self._buffers)
        return self._buffers

    def advance(self, count: int) -> None:
        """Takes the next `count` positions, written in place into the buffers open_rows returned."""
        self._length += count
        self._stale = True

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor,
                 held: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Makes room for `needed` positions, keeping the first self._length of `held`."""
        if self._buffers is not None and self._buffers[0].shape[-2] >= needed \
                and self._buffers[0].shape[:2] == key_states.shape[:2]:
            return
        capacity = room(needed, self._buffers[0].shape[-2] if self._buffers is not None else 0)
        k = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[-1])
        v = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[-1])
        if held is not None and self._length:
            k[..., :self._length, :] = held[0][..., :self._length, :]
            v[..., :self._length, :] = held[1][..., :self._length, :]
        self._buffers, self._arena = (k, v), None  # out of any arena now (and not keeping it alive)

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove positions (negative, as DynamicLayer.crop takes it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if not self._owned():
            super().crop(tokens_to_remove)  # someone else's tensors: slice them as DynamicLayer would
            return
        self._length = max(0, self._length - abs(tokens_to_remove))
        self._stale = True  # as advance(): the views are made when next read, often never (the one-call stack)


def full_attention(layer) -> bool:
    """Layers whose positions line up one to one with the sequence's (no sliding window)."""
    return type(layer) in (DynamicLayer, GrowingLayer)


def new_cache(config) -> DynamicCache:
    """transformers' DynamicCache for `config`, its full-attention layers appending in place.

    Sliding-window and other special layers keep transformers' own classes."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


# --- one tensor per sequence for every layer (batched forwards, specdec/forward/batching.py) ---------------

def arena_of(cache) -> torch.Tensor | None:
    """The [L, 2, H, capacity, D] tensor that holds every layer's key and value buffers of `cache`
    as views (bind_arena), or None if any layer no longer keeps its buffers there (a layer that
    outgrew its room in a forward of its own reallocated just itself, and let go of the arena).

    Each layer names its arena (views made under torch.inference_mode() do not record their base),
    and its buffers must still start where that arena puts them."""
    layers = getattr(cache, "layers", None)
    if not layers or not isinstance(layers[0], GrowingLayer):
        return None
    arena = layers[0]._arena
    if arena is None or arena.dim() != 5 or arena.shape[0] != len(layers) or arena.shape[1] != 2:
        return None
    base, step, length = arena.data_ptr(), arena.stride(1) * arena.element_size(), layers[0]._length
    for index, layer in enumerate(layers):
        if not isinstance(layer, GrowingLayer) or layer._arena is not arena or not layer._owned() or layer._length != length:
            return None
        keys, values = layer._buffers
        if keys.data_ptr() != base + 2 * index * step or values.data_ptr() != base + (2 * index + 1) * step \
                or keys.shape[-2] != arena.shape[-2]:
            return None
    return arena


def bind_arena(cache, arena: torch.Tensor, length: int) -> None:
    """Makes every layer of `cache` (GrowingLayers) keep its keys and values in `arena`
    [L, 2, H, capacity, D], its first `length` positions being the cache. A forward on the sequence
    alone then appends into the arena in place, as into any GrowingLayer."""
    for index, layer in enumerate(cache.layers):
        layer.dtype, layer.device, layer.is_initialized = arena.dtype, arena.device, True
        layer._buffers, layer._length, layer._arena = (arena[index, 0][None], arena[index, 1][None]), length, arena
        layer._expose()


def set_arena_length(cache, length: int) -> None:
    """Moves the end of every layer of a cache bound to an arena (bind_arena) with room for
    `length`: a batched write-back that only appended positions in place."""
    for layer in cache.layers:
        layer._length = length
        layer._expose()


def arena_shape(cache) -> tuple[int, int, int] | None:
    """(L, H, D) when every layer is a GrowingLayer holding keys and values of one shape, the
    condition for one arena to hold them all; None otherwise (or when nothing is cached yet)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(layer, GrowingLayer) and layer.is_initialized and layer.keys.dim() == 4
                             for layer in layers):
        return None
    first = layers[0].keys
    shape = (first.shape[1], first.shape[3])
    for layer in layers:
        if (layer.keys.shape[1], layer.keys.shape[3]) != shape or (layer.values.shape[1], layer.values.shape[3]) != shape \
                or layer.keys.shape[2] != first.shape[2] or layer.values.shape[2] != first.shape[2] \
                or layer.keys.dtype != first.dtype or layer.values.dtype != first.dtype:
            return None
    return len(layers), shape[0], shape[1]


def new_arena(like: torch.Tensor, layers: int, heads: int, dim: int, needed: int, held: int = 0) -> torch.Tensor:
    """An arena with `room` for `needed` positions, growing from one of `held` positions."""
    return like.new_empty(layers, 2, heads, room(needed, held), dim)


def move_to_arena(cache, needed: int) -> torch.Tensor:
    """Copies a cache whose layers have one shape (arena_shape) into a new arena with room for
    `needed` positions and binds the layers to it: one copy per layer, once per sequence (and
    again only if a forward of its own outgrows the room)."""
    layers, heads, dim = arena_shape(cache)
    length = cache.layers[0].keys.shape[-2]
    arena = new_arena(cache.layers[0].keys, layers, heads, dim, max(needed, length))
    for index, layer in enumerate(cache.layers):
        arena[index, 0, :, :length] = layer.keys[0, :, :length]
        arena[index, 1, :, :length] = layer.values[0, :, :length]
    bind_arena(cache, arena, length)
    return arena
