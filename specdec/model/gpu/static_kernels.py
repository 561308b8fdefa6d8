"""The pieces of a fixed-shape pass (specdec/model/gpu/static.py): RMS norm and rotary positions as
transformers computes them, and attention over each query's logical key list in blocks of BLOCK
keys with an online softmax: a torch loop (`attention_reference`, also the tests' oracle) and the
same blocks as one Triton kernel on CUDA (`_attention_triton`).

Apart from static.py (the static cache, its slots and the passes) because these are the numerics:
what makes a row's bits independent of the pass it rides in is here, and nowhere else.
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds run the torch loop
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

BLOCK = 64  # keys per block of the online softmax: part of the numerics, never changes with the pass


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm (float32 per row, scaled back in the model's dtype), with
    torch's fused kernel for the normalisation: a pass is launch-bound, so kernels count."""
    f = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * f.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions as transformers applies them (rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                        prefix: torch.Tensor, tail: torch.Tensor, tail_len: torch.Tensor, scale: float) -> torch.Tensor:
    """Each query over its logical key list in blocks of BLOCK, online softmax in float32.

    q [T, H, D]; keys/values [S, G, C, D]; slots, prefix, tail_len [T]; tail [T, MAX_TAIL].
    Returns [T, H, D] in q's dtype. A block past a query's list changes nothing (its scores are
    -inf: the running maximum stays, the rescale factor is exactly 1, the added terms exactly 0), so
    the number of blocks a pass runs does not enter a row's bits."""
    T, H, D = q.shape
    group = H // keys.shape[1]
    n = prefix + tail_len  # [T]
    qf = q.float()
    m = torch.full((T, H), -math.inf, device=q.device)
    total = torch.zeros(T, H, device=q.device)
    acc = torch.zeros(T, H, D, device=q.device)
    for start in range(0, int(n.max()), BLOCK):
        j = start + torch.arange(BLOCK, device=q.device)[None]  # [1, BLOCK]
        valid = j < n[:, None]  # [T, BLOCK]
        in_tail = j >= prefix[:, None]
        at = (j - prefix[:, None]).clamp(0, tail.shape[1] - 1)
        index = torch.where(in_tail, tail.gather(1, at), j).clamp(0, keys.shape[2] - 1)
        index = torch.where(valid, index, 0)
        k = keys[slots[:, None], :, index].float().repeat_interleave(group, dim=2)  # [T, BLOCK, H, D]
        v = values[slots[:, None], :, index].float().repeat_interleave(group, dim=2)
        s = (k * qf[:, None]).sum(-1) * scale  # [T, BLOCK, H]
        s = s.masked_fill(~valid[:, :, None], -math.inf)
        m_new = torch.maximum(m, s.amax(1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        total = total * alpha + p.sum(1)
        acc = acc * alpha[..., None] + (p[..., None] * v).sum(1)
        m = m_new
    return (acc / total[..., None]).to(q.dtype)


if triton is not None:
    @triton.jit
    def _attention_kernel(Q, K, V, O, SLOT, PREFIX, TAIL, TAIL_LEN, stride_qt, stride_qh, stride_ks, stride_kg, stride_kc,
                          stride_ot, stride_oh, stride_tail, scale, GROUP: tl.constexpr, D: tl.constexpr,
                          BLOCK_N: tl.constexpr):
        """One (query row, head): its logical key list in blocks of BLOCK_N, online softmax."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        g = h // GROUP
        slot = tl.load(SLOT + t).to(tl.int64)
        prefix = tl.load(PREFIX + t)
        n = prefix + tl.load(TAIL_LEN + t)
        d = tl.arange(0, D)
        q = tl.load(Q + t * stride_qt + h * stride_qh + d).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        base_k = K + slot * stride_ks + g * stride_kg
        base_v = V + slot * stride_ks + g * stride_kg
        for start in range(0, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            valid = j < n
            in_tail = j >= prefix
            tail_at = tl.where(in_tail & valid, j - prefix, 0)
            tail_index = tl.load(TAIL + t * stride_tail + tail_at, mask=in_tail & valid, other=0)
            index = tl.where(in_tail, tail_index, j).to(tl.int64)
            index = tl.where(valid, index, 0)
            k = tl.load(base_k + index[:, None] * stride_kc + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            total = total * alpha + tl.sum(p, axis=0)
            v = tl.load(base_v + index[:, None] * stride_kc + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        out = acc / total
        tl.store(O + t * stride_ot + h * stride_oh + d, out.to(O.dtype.element_ty))


def _attention_triton(q, keys, values, slots, prefix, tail, tail_len, scale):
    """attention_reference's blocks as one Triton kernel: one program per (row, head)."""
    T, H, D = q.shape
    out = q.new_empty(T, H, D)
    # strided q is fine (its last dim contiguous); the per-row fields are read at stride 1
    assert keys.stride() == values.stride() and keys.stride(-1) == 1 and q.stride(-1) == 1 and D & (D - 1) == 0
    assert slots.is_contiguous() and prefix.is_contiguous() and tail_len.is_contiguous() and tail.stride(1) == 1
    _attention_kernel[(T, H)](q, keys, values, out, slots, prefix, tail, tail_len, q.stride(0), q.stride(1), keys.stride(0),
                              keys.stride(1), keys.stride(2), out.stride(0), out.stride(1), tail.stride(0), scale,
                              GROUP=H // keys.shape[1], D=D, BLOCK_N=BLOCK)
    return out
