"""The whole decoder stack in one C call (specdec/model/cpu/stack.py, csrc/stack.c): for one sequence fed
from its cache it computes the same bits as the per-layer path (specdec/model/cpu/decoder.py) that
batches, trees and masks take, in a prefill, decode steps, a verify and after a rollback; it is
actually taken where it applies, and everything else falls back unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.kv.buffers import new_cache
from specdec.model.cpu import gemm, gemm_kernel, stack
from specdec.model.hfcache import cache_kwargs
from tests import tiny

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not gemm.available(CPU, torch.float32), reason="no C compiler to build the kernel")

COMPACT = ("bf16", "int8", "q4", "int8-a8", "q4-a8")


def _pair(weights: str, hidden: int = 64):
    """The same compact model twice: with the one-call stack, and with it taken off (per-layer path).
    hidden 64 gives heads of 16 (the attention's one-row path), 256 heads of 64 (its tiles, SmolLM2's)."""
    torch.manual_seed(5)
    target = LlamaForCausalLM(tiny.tiny_config(hidden=hidden)).eval()
    model, layered = copy.deepcopy(target), copy.deepcopy(target)
    for m in (model, layered):
        gemm.pack_linears(m, gemm.DEFAULT_ROWS, 1, weights)
        assert stack.installed(m.model) is not None, "the stack was not installed"
    del layered.model.forward  # the instance's forward: back to transformers' (per-layer) one
    return model, layered


def _feed(model, cache, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache), use_cache=True).logits[0]


@pytest.mark.parametrize("weights,hidden", [(w, 64) for w in COMPACT] + [("q4-a8", 256), ("bf16", 256)])
def test_the_stack_computes_the_per_layer_paths_bits(weights, hidden):
    """Prefill, decode steps, a 4-row verify, a rollback and a re-feed: every logit and every cached
    key and value equal between the two paths."""
    model, layered = _pair(weights, hidden)
    prompt = tiny.prompts(3, seed=6)[0] * 2
    caches = new_cache(model.config), new_cache(layered.config)
    script = [prompt[:20], [7], [9], [11], [3, 5, 8, 13], "crop 2", [21], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    for step in script:
        if step == "crop 2":
            for cache in caches:
                cache.crop(-2)
            continue
        got, want = _feed(model, caches[0], step), _feed(layered, caches[1], step)
        assert torch.equal(got, want), (weights, step)
    for mine, theirs in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_the_stack_is_what_runs_a_single_sequence(monkeypatch):
    """With the stack in place no layer's own forward runs for a single sequence fed from its cache."""
    model, _ = _pair("q4-a8")
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("layer ran")))
    cache = new_cache(model.config)
    _feed(model, cache, [1, 2, 3, 4, 5])
    _feed(model, cache, [6])
    assert cache.get_seq_length() == 6


def test_what_the_stack_does_not_cover_takes_the_per_layer_path():
    """A batch of two, an attention mask, hidden states asked for, no cache, a cache holding keys it
    did not make, and gemm.disabled(): all run transformers' forward and equal the per-layer model."""
    model, layered = _pair("int8-a8")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.inference_mode():
        for kwargs in ({"input_ids": ids}, {"input_ids": ids[:1], "attention_mask": torch.ones(1, 4, dtype=torch.long)},
                       {"input_ids": ids[:1], "output_hidden_states": True}):
            assert torch.equal(model(**kwargs).logits, layered(**kwargs).logits), kwargs
        with gemm.disabled():
            assert torch.equal(model(input_ids=ids).logits, layered(input_ids=ids).logits)
        cache = new_cache(model.config)
        _feed(model, cache, [1, 2, 3])
        for layer in cache.layers:  # someone else's tensors (a tree's path compaction does this)
            layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        reference = new_cache(layered.config)
        _feed(layered, reference, [1, 2, 3])
        assert torch.equal(_feed(model, cache, [4, 5]), _feed(layered, reference, [4, 5]))


def test_silu_mul_is_the_activation_within_rounding_and_finite_at_the_extremes():
    kernel = gemm_kernel.load()
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(1000) * 4, torch.tensor([0.0, -0.0, 87.9, -87.9, 100.0, -100.0, 1e30, -1e30])])
    up = torch.randn(gate.numel())
    out = torch.empty_like(gate)
    kernel.silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:1000], torch.nn.functional.silu(gate[:1000]) * up[:1000], rtol=2e-6, atol=1e-7)
    # the odd tail (n % 16) goes through the same vector code: a prefix of the same values agrees
    part = torch.empty(13)
    kernel.silu_mul(gate.data_ptr(), up.data_ptr(), 13, part.data_ptr())
    assert torch.equal(part, out[:13])


@pytest.mark.parametrize("weights", ["q4-a8", "bf16"])
def test_a_batch_of_chains_appends_to_each_sequences_own_cache_with_the_bits_of_each_alone(weights):
    """forward_batch over sequences of unlike cache lengths goes through the stack in one pass
    (pass_groups does not split them): each row's logits and cached keys equal that sequence fed
    alone, and write_back keeps exactly the accepted positions."""
    from specdec.forward.batching import forward_batch, pass_groups
    from specdec.kv.store import Sequence
    from specdec.model.lm import CausalLM

    model, layered = _pair(weights)
    lm, alone = CausalLM(model, CPU), CausalLM(layered, CPU)
    prompts = tiny.prompts(4, seed=9)
    seqs = [Sequence(f"s{i}", list(p)) for i, p in enumerate(prompts[:3])]
    twins = [Sequence(f"t{i}", list(p)) for i, p in enumerate(prompts[:3])]
    for seq, twin in zip(seqs[:2], twins[:2]):  # two rows with caches of their own and a token to feed, one new
        lm.forward(seq)
        alone.forward(twin)
        seq.tokens.append(17)
        twin.tokens.append(17)
    assert pass_groups(lm, [seq.cached for seq in seqs]) == [[0, 1, 2]]
    extras = [[5, 6, 7], [], [8]]
    keeps = [len(e) + 1 for e in extras]
    logits, state = forward_batch(lm, seqs, extras, keeps)
    assert isinstance(state, stack.DirectBatch)
    for seq, twin, extra, keep, got in zip(seqs, twins, extras, keeps, logits):
        want = alone.forward(twin, extra, keep=keep)
        assert torch.equal(got, want)
        state.write_back(seqs.index(seq), seq, lm, len(seq.tokens))  # the drafted tokens rejected
        twin.crop_cache(len(twin.tokens))
        assert seq.cached == len(seq.tokens) == twin.cached
        for mine, theirs in zip(seq.cache.layers, twin.cache.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_a_cache_that_outgrows_its_room_is_written_where_its_buffers_now_are():
    """The stack keeps each cache's buffer addresses between forwards (Stack._reopened): a cache
    that grows past its room several times, is cropped, and grows again must still get the per-layer
    path's bits at every step, and its keys must be the per-layer path's."""
    model, layered = _pair("q4-a8", hidden=256)
    caches = new_cache(model.config), new_cache(layered.config)
    tokens = tiny.prompts(1, seed=12)[0][:5]
    for step in range(300):
        if step == 150:
            for cache in caches:
                cache.crop(-40)
            tokens = tokens[:-40]
        got, want = _feed(model, caches[0], tokens[-1:] if step else tokens), _feed(layered, caches[1], tokens[-1:] if step else tokens)
        assert torch.equal(got, want), step
        tokens.append(int(got[-1].argmax()))
    for mine, theirs in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert caches[0].layers[0]._buffers[0].shape[-2] > 64  # it did outgrow its first room
