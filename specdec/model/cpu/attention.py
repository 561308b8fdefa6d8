"""Row-exact attention: a transformers attention implementation in which a query row's output does
not depend on the other rows of the forward (specdec/model/cpu/csrc/attention.c says why and how).

The model served with compact weights uses it (gemm.apply): speculation is exact only if a position
computes the same in a decode step and in a verify pass, and torch's CPU attention blocks one query
differently from several. It takes what transformers' SDPA path takes (the same mask builder, the
same conventions: no mask means causal over the last query rows) and hands anything it does not
cover (another device or dtype, gradients, dropout, sliding windows, soft-capping, attention sinks,
additive masks other than 0 / -inf) to SDPA unchanged, as it does inside `gemm.disabled()` (the fp32
reference the benchmark compares with).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.model.cpu import gemm_kernel, packed

NAME = "specdec_rows"
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


def _mask_bytes(mask: torch.Tensor, length: int) -> torch.Tensor | None:
    """A 4-D mask as allowed-bytes over the first `length` keys; None where it is not an allow/deny mask."""
    mask = mask[..., :length]
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    if not mask.is_floating_point():
        return None
    lowest = torch.finfo(mask.dtype).min / 2
    allowed = mask == 0
    if not bool((allowed | (mask <= lowest)).all()):
        return None  # a bias (ALiBi, relative positions): not this kernel's business
    return allowed.view(torch.uint8)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, Mq, D], key/value [B, Hkv, T, D] -> ([B, Mq, H, D], None), as SDPA's forward returns."""
    kernel = gemm_kernel.load() if packed.enabled() else None  # gemm.disabled(): the reference, SDPA
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = None if attention_mask is None else _mask_bytes(attention_mask, key.shape[-2])
    if (kernel is None or query.device.type != "cpu" or query.dtype != torch.float32 or key.dtype != torch.float32
            or query.requires_grad or (dropout and module.training) or any(kwargs.get(k) is not None for k in _UNSUPPORTED)
            or (attention_mask is not None and (mask is None or mask.dim() != 4))
            # no mask: SDPA's is_causal (query i sees keys 0..i), which transformers only leaves to it
            # for one query row or as many rows as keys; the kernel's causal rule agrees there
            or (attention_mask is None and query.shape[2] > 1 and (not causal or query.shape[2] != key.shape[2]))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, h, rows, d = query.shape
    heads_kv, length = key.shape[1], key.shape[2]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty(b, rows, h, d)
    if mask is not None:
        mask = mask.expand(b, h, rows, length)  # broadcast dimensions get stride 0
        ms = mask.stride()
        mask_args = (mask.data_ptr(), ms[0], ms[1], ms[2])
        if ms[3] != 1:
            mask = mask.contiguous()
            mask_args = (mask.data_ptr(), *mask.stride()[:3])
    else:
        mask_args = (None, 0, 0, 0)
    qs, ks, vs = query.stride(), key.stride(), value.stride()
    scale = scaling if scaling is not None else d ** -0.5
    if kernel.attention(query.data_ptr(), qs[0], qs[1], qs[2], key.data_ptr(), ks[0], ks[1], ks[2],
                        value.data_ptr(), vs[0], vs[1], vs[2], *mask_args, b, h, heads_kv, rows, length, d, scale,
                        out.data_ptr()):
        raise ValueError(f"row-exact attention refused query {tuple(query.shape)} against keys {tuple(key.shape)} "
                         "(or ran out of memory)")
    return out, None


def use(model: torch.nn.Module) -> bool:
    """Switches a model that computes with SDPA to row-exact attention; True if it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if not isinstance(model, PreTrainedModel) or model.config._attn_implementation != "sdpa":
        return False  # not a transformers model on SDPA (a feature draft's own layers, say)
    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the masks SDPA gets, with the same meaning
    model.set_attn_implementation(NAME)
    return True
