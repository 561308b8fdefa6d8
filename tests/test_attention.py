"""Row-exact attention (specdec/model/cpu/attention.py): a position's output is the same bits whether it is
computed alone (a decode step), among other query rows (a verify), under a tree's mask or padded in a
batch; it agrees with SDPA up to float rounding; what it does not cover goes to SDPA."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.kv.buffers import new_cache
from specdec.model.cpu import attention, gemm
from tests import tiny

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not gemm.available(CPU, torch.float32), reason="no C compiler to build the kernel")


class Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 3


def _qkv(rows: int, keys: int, seed: int = 0, dim: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 6, rows, dim, generator=g), torch.randn(2, 2, keys, dim, generator=g) * 2,
            torch.randn(2, 2, keys, dim, generator=g))


# Head sizes that are multiples of 16 (but 112) run the kernel's tiles of several query rows
# (csrc/attention.c attend_tile: 64 and 128, and 16 and 80 of the smaller and odd tiles), any other
# size its one-row path: each must give a row the same bits alone or among others.
DIMS = (16, 40, 64, 80, 128)


@pytest.mark.parametrize("dim", DIMS)
def test_agrees_with_sdpa_with_and_without_masks(dim):
    module = Module().eval()
    q, k, v = _qkv(7, 7, dim=dim)
    ours, _ = attention.attention_forward(module, q, k, v, None, scaling=0.2)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.2)
    assert torch.allclose(ours, theirs, atol=1e-5)
    q, k, v = _qkv(5, 30, seed=1, dim=dim)
    allowed = torch.rand(2, 1, 5, 30, generator=torch.Generator().manual_seed(2)) > 0.4
    allowed[..., 0] = True
    ours, _ = attention.attention_forward(module, q, k, v, allowed, scaling=0.2)
    theirs, _ = sdpa_attention_forward(module, q, k, v, allowed, scaling=0.2)
    assert torch.allclose(ours, theirs, atol=1e-5)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)  # a tree's mask
    assert torch.equal(attention.attention_forward(module, q, k, v, additive, scaling=0.2)[0], ours)


@pytest.mark.parametrize("dim", DIMS)
def test_a_rows_output_is_the_same_alone_masked_or_among_others(dim):
    module = Module().eval()
    q, k, v = _qkv(6, 20, seed=3, dim=dim)
    mask = torch.ones(2, 1, 6, 20, dtype=torch.bool).tril(diagonal=14)  # causal: row i sees keys 0..14+i
    together, _ = attention.attention_forward(module, q, k, v, mask, scaling=0.2)
    prompt_q = torch.cat([q, q[:, :, :3]], dim=2)[:, :, :9]  # a prompt: 9 rows over its own 9 keys, unmasked
    prompt, _ = attention.attention_forward(module, prompt_q, k[:, :, :9], v[:, :, :9], None, scaling=0.2)
    prompt_masked, _ = attention.attention_forward(module, prompt_q, k[:, :, :9], v[:, :, :9],
                                                   torch.ones(2, 1, 9, 9, dtype=torch.bool).tril(), scaling=0.2)
    assert torch.equal(prompt, prompt_masked)
    for i in range(6):
        seen = 15 + i
        alone, _ = attention.attention_forward(module, q[:, :, i:i + 1], k[:, :, :seen], v[:, :, :seen], None, scaling=0.2)
        assert torch.equal(alone[:, 0], together[:, i]), i
        # in a tile of its own, starting at this row, beside rows that see more
        later, _ = attention.attention_forward(module, q[:, :, i:], k, v, mask[:, :, i:], scaling=0.2)
        assert torch.equal(later[:, 0], together[:, i]), i
    # padding in front of the keys (a batch's row): the same keys in the same order give the same bits
    padded_k = torch.cat([torch.randn(2, 2, 3, dim), k], dim=2)
    padded_v = torch.cat([torch.randn(2, 2, 3, dim), v], dim=2)
    padded_mask = torch.cat([torch.zeros(2, 1, 6, 3, dtype=torch.bool), mask], dim=3)
    padded, _ = attention.attention_forward(module, q, padded_k, padded_v, padded_mask, scaling=0.2)
    assert torch.equal(padded, together)


def test_what_it_does_not_cover_goes_to_sdpa():
    module = Module().eval()
    q, k, v = _qkv(4, 9, seed=4)
    mask = torch.ones(2, 1, 4, 9, dtype=torch.bool).tril(diagonal=5)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.2, sliding_window=3)
    assert torch.equal(attention.attention_forward(module, q, k, v, mask, scaling=0.2, sliding_window=3)[0], expected)
    bias = torch.randn(2, 1, 4, 9)  # a positional bias, not an allow/deny mask
    assert torch.equal(attention.attention_forward(module, q, k, v, bias, scaling=0.2)[0],
                       sdpa_attention_forward(module, q, k, v, bias, scaling=0.2)[0])
    with gemm.disabled():
        assert torch.equal(attention.attention_forward(module, q, k, v, mask, scaling=0.2)[0],
                           sdpa_attention_forward(module, q, k, v, mask, scaling=0.2)[0])


@pytest.mark.parametrize("weights", ["q4-a8", "int8"])
def test_the_compact_model_computes_a_position_alike_in_one_pass_or_several(weights):
    """What speculation's exactness stands on: the last position's logits from the whole prompt in one
    forward equal those of a prefix forward followed by 1, 3 or 6 more rows, bit for bit."""
    target, _ = tiny.tiny_pair(seed=5)
    model = copy.deepcopy(target)
    gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, weights)
    assert model.config._attn_implementation == attention.NAME
    lean = [layer for layer in model.model.layers if hasattr(layer, "_specdec_kernel")]  # specdec/model/cpu/decoder.py
    assert len(lean) == len(model.model.layers)
    assert_alike_in_one_pass_or_several(model)


def assert_alike_in_one_pass_or_several(model) -> torch.Tensor:
    """The last positions' logits of a prompt in one forward equal those of a prefix forward followed
    by 1, 3 or 6 more rows, bit for bit; returns the whole forward's logits."""
    ids = torch.tensor([tiny.prompts(1, seed=6)[0] * 3])[:, :30]
    with torch.inference_mode():
        whole = model(input_ids=ids).logits[0]
        for tail in (1, 3, 6):
            cache = new_cache(model.config)
            model(input_ids=ids[:, :-tail], past_key_values=cache, use_cache=True)
            last = model(input_ids=ids[:, -tail:], past_key_values=cache, use_cache=True).logits[0]
            assert torch.equal(last, whole[-tail:]), tail
    return whole


def test_fp32_is_row_exact_too():
    """fp32 serves with the row-exact attention as well (it agrees with SDPA, the attention of
    transformers' generate(), up to rounding): a position's logits are the same bits in one pass or
    after a prefix, which with SDPA they are not."""
    target, _ = tiny.tiny_pair(seed=5)
    model = copy.deepcopy(target)
    gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, "fp32")
    assert model.config._attn_implementation == attention.NAME
    whole = assert_alike_in_one_pass_or_several(model)
    ids = torch.tensor([tiny.prompts(1, seed=6)[0] * 3])[:, :30]
    with torch.inference_mode():
        torch.testing.assert_close(whole, target(input_ids=ids).logits[0], rtol=1e-4, atol=1e-4)
