"""A lean forward for the decoder layers of compact Llama-family models.

Why: with compact weights a small model's decode step reads little memory, yet transformers'
eager layer forward around those reads makes dozens of tensor operations and module calls per
layer, each paying Python and dispatch: over a whole model, as much time again as the weights.
llama.cpp, the tool CPU users compare with, has none of
that. This forward computes the same layer with fewer, larger steps: one call for the RMS norms
(gemm_kernel's sg_rmsnorm), one kernel call for q/k/v and one for gate/up (their LinearGroups), the
row-exact attention called directly, the MLP's activation in C (sg_silu_mul), and transformers' own
rotary embedding and cache update. A single sequence's forward skips even this loop:
specdec/model/cpu/stack.py runs the whole stack in one C call through the same functions.

It is installed only where it computes exactly what the layer means (`use`): a LlamaDecoderLayer
whose projections are grouped compact layers, with SiLU and the row-exact attention; anything else
keeps transformers' forward. It is part of the compact model's definition (the RMS norm sums in
another order than torch's, and SiLU's exponential is the kernel's own): every forward of that model, decode, verify, batch or prefill, runs
it, and each row is computed alone, so speculation stays exact against the model. Inside
`gemm.disabled()` (the fp32 reference) and with gradients the layer runs transformers' forward.
"""

from __future__ import annotations

import sys
import types

import torch

from specdec.model.cpu import attention, gemm_kernel, packed


def _rmsnorm(kernel: gemm_kernel.Kernel, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    y = torch.empty_like(x)
    kernel.rmsnorm(x.data_ptr(), x.shape[0], x.shape[1], norm.weight.data_ptr(), norm.variance_epsilon, y.data_ptr())
    return y


def _forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids=None,
             cache=None, use_cache: bool | None = False, position_embeddings=None, **kwargs) -> torch.Tensor:
    cache = kwargs.pop("past_key_values", cache)
    if (not packed.enabled() or hidden_states.dtype != torch.float32 or hidden_states.requires_grad
            or not hidden_states.is_contiguous() or position_embeddings is None):
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    attn, mlp, kernel = self.self_attn, self.mlp, self._specdec_kernel
    b, rows, width = hidden_states.shape
    x = hidden_states.view(b * rows, width)
    q, k, v = attn.q_proj.group.compute(_rmsnorm(kernel, x, self.input_layernorm))
    shape = (b, rows, -1, attn.head_dim)
    q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = self._specdec_rotary(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    out, _ = attention.attention_forward(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                                         position_ids=position_ids, **kwargs)
    x = x + attn.o_proj(out.reshape(b * rows, -1))
    gate, up = mlp.gate_proj.group.compute(_rmsnorm(kernel, x, self.post_attention_layernorm))
    act = torch.empty_like(gate)
    kernel.silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), act.data_ptr())
    x = x + mlp.down_proj(act)
    return x.view(b, rows, width)


def _eligible(layer: torch.nn.Module) -> bool:
    if type(layer).__name__ != "LlamaDecoderLayer":
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if attn is None or mlp is None or any(type(n).__name__ != "LlamaRMSNorm" for n in norms):
        return False
    grouped = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")], [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    for members in grouped:
        group = getattr(members[0], "group", None)
        if group is None or group.members != members:
            return False
    config = getattr(attn, "config", None)
    return (getattr(config, "hidden_act", None) == "silu" and getattr(config, "_attn_implementation", None) == attention.NAME
            and isinstance(attn.o_proj, packed.PackedLinear) and isinstance(mlp.down_proj, packed.PackedLinear)
            and hasattr(sys.modules[type(layer).__module__], "apply_rotary_pos_emb"))


def use(model: torch.nn.Module) -> int:
    """Gives each eligible decoder layer the lean forward; returns how many."""
    kernel = gemm_kernel.load()
    count = 0
    for layer in model.modules():
        if kernel is not None and _eligible(layer):
            layer._specdec_kernel = kernel
            layer._specdec_rotary = sys.modules[type(layer).__module__].apply_rotary_pos_emb
            layer.forward = types.MethodType(_forward, layer)
            count += 1
    return count
