"""One C call for a compact Llama-family model's whole decoder stack (csrc/stack.c), where it applies.

Why: a decode step of SmolLM2-135M with compact weights is ~120 cheap kernel calls, and from Python
each pays the interpreter, a ctypes call, allocations, views and the cache's bookkeeping: about a
third of the step on two cores, the margin by which llama.cpp decoded faster (docs/benchmarks.md).
This module gives the model's decoder (`model.model`) a forward that, for one sequence fed from its
own cache (what a decode step, a chain verify and a prompt chunk are), embeds the tokens, takes
transformers' rotary cos/sin, makes room in each layer's GrowingLayer, and hands everything else to
`sg_stack`; the final norm and the output layer stay in Python (the norm's hook feeds the feature
drafts). The C stack calls the same functions as the per-layer path (specdec/model/cpu/decoder.py), so
its rows are bit-identical to that path's, which batches, trees and masks keep taking
(tests/test_decoder_stack.py holds the two against each other).

A forward is eligible when: the kernel is on (not inside `gemm.disabled()`), no gradients, one row
of input ids, no attention mask or position ids of the caller's own, a cache whose layers are all
GrowingLayers holding what they made, and nobody asked for hidden states or attentions or hooked a
layer. Anything else runs transformers' forward, unchanged.
"""

from __future__ import annotations

import ctypes
import types
import weakref
from typing import Protocol, runtime_checkable

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from specdec.kv.buffers import GrowingLayer
from specdec.model.cpu import gemm_kernel, packed
from specdec.model.hfcache import output_field

_p = ctypes.c_void_p


@runtime_checkable
class HasDecoder(Protocol):
    """A model whose decoder stack (embeddings aside) `get_decoder` returns, as transformers names it."""

    def get_decoder(self) -> torch.nn.Module: ...


class _Weight(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int), ("parts", ctypes.c_int), ("N", ctypes.c_int * 3), ("wp", _p), ("sc", _p),
                ("mn", _p), ("bias", _p * 3)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", _p), ("norm2", _p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("scale", ctypes.c_float), ("qkv", _Weight), ("o", _Weight), ("gateup", _Weight), ("down", _Weight)]


def _weight(members: list[packed.PackedLinear]) -> _Weight:
    """The kernel's view of one projection, or of a LinearGroup's joined panels (q/k/v, gate/up)."""
    group = members[0].group
    held = group.weight if group is not None else members[0].compact
    w = _Weight(fmt=held.code, parts=len(members), wp=held.panels.data_ptr(),
                sc=None if held.scales is None else held.scales.data_ptr(),
                mn=None if held.mins is None else held.mins.data_ptr())
    for i, member in enumerate(members):
        w.N[i] = member.out_features
        w.bias[i] = None if member._bias is None else member._bias.data_ptr()
    return w


class Stack:
    """The fixed arguments of sg_stack for one model, built once: weights never move while serving."""

    def __init__(self, decoder: torch.nn.Module, kernel: gemm_kernel.Kernel):
        layers = list(decoder.layers[: decoder.config.num_hidden_layers])
        attn = layers[0].self_attn
        config = decoder.config
        self.kernel, self.layers = kernel, layers
        self.hidden = int(config.hidden_size)
        self.heads, self.kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        self.head_dim, self.intermediate = int(attn.head_dim), int(layers[0].mlp.gate_proj.out_features)
        self._table = None  # built on first use (and again in a copy: ctypes pointers do not copy)
        self._template = torch.empty(1, self.kv_heads, 0, self.head_dim)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_table": None}  # a deep copy of the model builds its own from its own weights

    def _build(self):
        self._table = (_Layer * len(self.layers))()
        for entry, layer in zip(self._table, self.layers):
            a, m = layer.self_attn, layer.mlp
            entry.norm1, entry.norm2 = layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()
            entry.eps1, entry.eps2 = layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon
            entry.scale = a.scaling
            entry.qkv, entry.o = _weight([a.q_proj, a.k_proj, a.v_proj]), _weight([a.o_proj])
            entry.gateup, entry.down = _weight([m.gate_proj, m.up_proj]), _weight([m.down_proj])
        return self._table

    def _past(self, cache) -> int | None:
        """What a cache holds, if this path can append to it: every layer a GrowingLayer, one length."""
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.layers) or any(type(layer) is not GrowingLayer for layer in layers):
            return None
        lengths = {layer._length if layer.is_initialized else 0 for layer in layers}
        return lengths.pop() if len(lengths) == 1 else None

    def run(self, x: torch.Tensor, caches: list, rows: list[int], cos: torch.Tensor, sin: torch.Tensor,
            pasts: list[int] | None = None) -> bool:
        """x [sum(rows), hidden] (contiguous float32, overwritten with the stack's output): rows[g] new
        positions of the sequence whose cache is caches[g], one sequence after another; cos/sin
        [sum(rows), head_dim]. False, computing nothing, where some cache is not one this path can
        append to (the caller then takes transformers' path). `pasts`: what _past says of each cache,
        where the caller has just asked it (a pass of 64 rows asks 64 caches)."""
        pasts = [self._past(cache) for cache in caches] if pasts is None else pasts
        if None in pasts:
            return False
        pointers, strides = [], []
        for cache, count, past in zip(caches, rows, pasts):
            opened = self._reopened(cache, past + count) or self._open(cache, count)
            if opened is None:
                return False
            pointers += opened[0]
            strides += opened[1]
        groups = len(caches)
        kv, st = (ctypes.c_void_p * len(pointers))(*pointers), (ctypes.c_long * len(strides))(*strides)
        counts, starts = (ctypes.c_int * groups)(*rows), (ctypes.c_int * groups)(*pasts)
        if self.kernel.stack(ctypes.addressof(self._table or self._build()), len(self.layers), groups, counts, starts, kv,
                             st, x.data_ptr(), self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                             cos.data_ptr(), sin.data_ptr()):
            raise ValueError(f"the decoder stack refused rows {rows} after {pasts} cached positions (out of memory?)")
        for cache, count in zip(caches, rows):
            for layer in cache.layers:
                layer.advance(count)
        return True

    def _open(self, cache, count: int) -> tuple[list[int], list[int]] | None:
        """Room for `count` more positions in every layer of `cache`: the buffers' addresses and
        strides, which the cache keeps (_reopened) until a layer's buffers change; None where some
        layer's are not ones this path can write (layers opened before it keep their larger room
        and their contents)."""
        pointers, strides, held = [], [], []
        for layer in cache.layers:
            buffers = layer.open_rows(count, self._template)
            if buffers is None or buffers[0].shape[:2] != (1, self.kv_heads) or buffers[0].shape[-1] != self.head_dim:
                return None
            k, v = buffers
            pointers += (k.data_ptr(), v.data_ptr())
            strides += (k.stride(1), k.stride(2), v.stride(1), v.stride(2))
            held.append(buffers)
        capacity = min(min(k.shape[-2], v.shape[-2]) for k, v in held)
        # weak: a cache whose layers move to other buffers (an arena, a replacement) frees the old ones
        cache._specdec_opened = ([(weakref.ref(k), weakref.ref(v)) for k, v in held], capacity, pointers, strides)
        return pointers, strides

    @staticmethod
    def _reopened(cache, needed: int) -> tuple[list[int], list[int]] | None:
        """The addresses _open found last time, if every layer still writes into the same buffers
        (none grew, was replaced or was adopted from someone else) with room for `needed` positions.

        Why: asking each layer for its buffers, their addresses and strides is a dozen Python and
        tensor calls a layer, 240 layers for 8 sequences of a 30-layer model, a measurable share of
        a batched pass (docs/benchmarks.md), while the buffers change only when a sequence outgrows them."""
        saved = getattr(cache, "_specdec_opened", None)
        if saved is None or saved[1] < needed:
            return None
        for layer, (k, v) in zip(cache.layers, saved[0]):
            buffers = layer._buffers
            if buffers is None or buffers[0] is not k() or buffers[1] is not v() or not layer._owned():
                return None
        return saved[2], saved[3]

    def feed(self, decoder: torch.nn.Module, ids: list[int] | torch.Tensor, positions: list[int], caches: list,
             rows: list[int], pasts: list[int] | None = None) -> torch.Tensor | None:
        """The decoder's token embeddings for `ids` (rows[g] of sequence g's, at their positions)
        through the stack: [1, sum(rows), hidden] before the final norm; None, feeding nothing, where
        some cache is not one this path can append to."""
        ids = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids])
        return self.feed_embeds(decoder, decoder.embed_tokens(ids), positions, caches, rows, pasts)

    def feed_embeds(self, decoder: torch.nn.Module, x: torch.Tensor, positions: list[int], caches: list,
                    rows: list[int], pasts: list[int] | None = None) -> torch.Tensor | None:
        """feed, from input embeddings x [1, sum(rows), hidden] (contiguous, overwritten): a feature
        draft's inputs are not token embeddings."""
        cos, sin = decoder.rotary_emb(x, position_ids=torch.tensor([positions]))
        if x.dtype != torch.float32 or not self.run(x.view(sum(rows), -1), caches, rows, cos[0].contiguous(),
                                                    sin[0].contiguous(), pasts):
            return None
        return x

    def usable(self) -> bool:
        """Whether a forward may take this path now (caches aside): the kernel on, no gradients, no hooks."""
        return (packed.enabled() and not torch.is_grad_enabled()
                and not any(layer._forward_hooks or layer._forward_pre_hooks for layer in self.layers))


_REFUSED = ("output_attentions", "output_hidden_states")


def _forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None,
             use_cache: bool | None = None, **kwargs):
    cache = kwargs.pop("past_key_values", cache)
    stack = installed(self)
    if (input_ids is None or inputs_embeds is not None or attention_mask is not None or position_ids is not None
            or cache is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or any(kwargs.get(name) for name in _REFUSED)
            or not stack.usable()):
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    rows, past = input_ids.shape[1], stack._past(cache)
    x = None if past is None else stack.feed(self, input_ids, list(range(past, past + rows)), [cache], [rows])
    if x is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    return BaseModelOutputWithPast(**{"last_hidden_state": self.norm(x), output_field(BaseModelOutputWithPast): cache})


def use(model: torch.nn.Module) -> bool:
    """Gives the decoder of a causal LM (or of a feature draft) whose every layer runs the lean forward
    (decoder.use) the one-call stack; True if it did."""
    # transformers' causal LMs and a feature draft (specdec/model/feature_draft.py, its body) name their decoder
    decoder = model.get_decoder() if isinstance(model, HasDecoder) else None
    kernel = gemm_kernel.load()
    layers = getattr(decoder, "layers", None)
    if kernel is None or layers is None or type(decoder).__name__ != "LlamaModel" or not len(layers):
        return False
    if not all(getattr(layer, "_specdec_kernel", None) is kernel for layer in layers[: decoder.config.num_hidden_layers]):
        return False  # some layer keeps transformers' forward: the stack would not compute the same
    config = decoder.config
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"])):
        return False
    setattr(decoder, _INSTALLED, Stack(decoder, kernel))
    decoder.forward = types.MethodType(_forward, decoder)
    return True


def forward_embeds(decoder: torch.nn.Module, x: torch.Tensor, cache) -> torch.Tensor | None:
    """The stack over input embeddings x [1, T, hidden] of ONE sequence appended to `cache`: its
    output before the final norm; None, feeding nothing, where this path does not apply (no stack,
    gradients, hooks, another dtype, a cache it cannot append to).

    Why: a feature draft drafts one pair a forward, and transformers' model forward around its one
    layer (masks, rotary, output records) cost as much as the layer's weights
    (benchmarks/results/feature-draft-stack/)."""
    stack = installed(decoder)
    if stack is None or x.dim() != 3 or x.shape[0] != 1 or x.dtype != torch.float32 or not stack.usable():
        return None
    past = stack._past(cache)
    if past is None:
        return None
    rows = x.shape[1]
    return stack.feed_embeds(decoder, x.contiguous(), list(range(past, past + rows)), [cache], [rows])


def installed(decoder: torch.nn.Module) -> Stack | None:
    """The Stack `use` gave this decoder, or None. It rides on the decoder itself (not in a table
    here) so that a deep copy of a packed model carries its own, as it carries its own weights."""
    return getattr(decoder, _INSTALLED, None)


_INSTALLED = "_specdec_stack"


def applies(lm) -> bool:
    """Whether lm's chains can go through forward_rows (caches and hooks aside): a Llama whose
    decoder `use` gave the stack, which the loader's gemm.apply does for compact weights. The head
    is transformers' own, over the whole vocabulary (a pruned draft is another type)."""
    model = lm.model
    return type(model).__name__ == "LlamaForCausalLM" and installed(model.get_decoder()) is not None


def forward_rows(lm, seqs: list, pending: list[list[int]], keeps: list[int]) -> list[torch.Tensor] | None:
    """Several sequences' chains in one pass of the stack, each appending to its own cache (no padding,
    no copies in or out): the float32 logits of each one's last keeps[i] positions, as
    specdec.forward.batching.forward_batch returns them; None where this path does not apply (then
    nothing was fed). The caller crops each sequence's cache to what it accepts (DirectBatch).

    Why: the padded batch copies every row's cache into one tensor and back, pads every row to the
    longest cache, and runs transformers' per-layer forward; here the linear layers still read their
    weights once for all rows, and each row's attention reads its own cache where it lies."""
    if not applies(lm):
        return None
    model = lm.model
    decoder = model.get_decoder()
    stack = installed(decoder)
    if lm.capturing or not stack.usable():
        return None  # features wanted (the padded batch hands them out per row), or hooks, or no kernel
    caches, pasts = [], []
    for seq in seqs:
        if seq.cache is None:
            seq.cache = lm.new_cache()
        if stack._past(seq.cache) != seq.cached:
            return None
        caches.append(seq.cache)
        pasts.append(seq.cached)
    ids, positions, kept, end = [], [], [], 0
    for seq, tokens, keep in zip(seqs, pending, keeps):
        ids += tokens
        positions += range(seq.cached, seq.cached + len(tokens))
        end += len(tokens)
        kept += range(end - keep, end)  # the positions whose logits are kept, in one index
    with torch.inference_mode():
        x = stack.feed(decoder, ids, positions, caches, [len(t) for t in pending], pasts)
        if x is None:
            return None
        hidden = decoder.norm(x)[0]
        logits = model.lm_head(hidden.index_select(0, torch.tensor(kept))).float()
    for seq, tokens in zip(seqs, pending):
        seq.cached += len(tokens)
    return list(logits.split(keeps))


class DirectBatch:
    """forward_rows' state: every row already holds its keys in its own cache, so writing back is
    cropping to the accepted positions (as specdec/model/gpu/static.py's StaticBatch does on a GPU)."""

    def write_back(self, i: int, seq, lm, length: int, extra: list[int] = ()) -> None:
        if extra:
            raise ValueError("a tree's path cannot be written back from the stack's rows: trees take the padded batch")
        seq.crop_cache(length)
