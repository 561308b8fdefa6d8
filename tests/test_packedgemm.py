"""MKL packed GEMM for verification forwards (specdec/packedgemm.py): same results, same tokens."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from coordinator.adapt import MODEL_DRAFT_PRIOR, CostModel
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from draft_service.engine import DraftEngine, ModelDrafter
from specdec import packedgemm
from specdec.kvcache import Sequence
from specdec.lm import CausalLM
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests import tiny
from tests.test_loop import MAX_NEW, run

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packedgemm.available(CPU, torch.float32), reason="torch built without MKL's packed sgemm")


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=3)


def packed_copy(model, rows=8, min_rows=5):
    model = copy.deepcopy(model)
    report = packedgemm.pack_linears(model, rows, min_rows)
    return model, report


def test_a_packed_layer_matches_the_stock_kernel_and_rows_do_not_interact():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    layer = packedgemm.PackedLinear(linear, rows=8, min_rows=3)
    for n in range(1, 11):
        x = torch.randn(1, n, 48)
        out = layer(x)
        assert out.shape == (1, n, 80)
        if 3 <= n <= 8:
            torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
        else:  # outside the packed range the stock kernel runs: bit-identical
            assert torch.equal(out, linear(x))
    # Padding is sound only if a row's result does not depend on the other rows in the call.
    x = torch.randn(5, 48)
    alone = layer(x)
    with_others = torch.ops.mkl._mkl_linear(torch.cat([x, torch.randn(3, 48)]), layer.packed, layer.weight, layer.bias, 8)[:5]
    assert torch.equal(alone, with_others)


def test_disabled_runs_the_stock_kernel():
    linear = torch.nn.Linear(32, 40)
    layer = packedgemm.PackedLinear(linear, rows=4, min_rows=2)
    x = torch.randn(3, 32)
    packed = torch.ops.mkl._mkl_linear(torch.nn.functional.pad(x, (0, 0, 0, 1)), layer.packed, layer.weight, layer.bias, 4)[:3]
    with packedgemm.disabled():
        assert torch.equal(layer(x), linear(x))
    assert torch.equal(layer(x), packed)  # back on after the block


def test_packing_keeps_the_models_parameters_ties_and_state_dict(pair):
    target, _ = pair
    tied = copy.deepcopy(target)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    keys = list(tied.state_dict())
    report = packedgemm.pack_linears(tied, 8, 5)
    assert report.layers == sum(isinstance(m, packedgemm.PackedLinear) for m in tied.modules()) > 0
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert list(tied.state_dict()) == keys
    assert not any(type(m) is torch.nn.Linear for m in tied.modules())


def test_verify_logits_agree_with_the_stock_path(pair):
    target, _ = pair
    model, _ = packed_copy(target)
    lm = CausalLM(model, CPU)
    context = tiny.prompts(1, seed=4)[0]
    for n in (1, 4, 5, 8, 9):
        logits = {}
        for arm in ("stock", "packed"):
            seq = Sequence(arm, tokens=list(context))
            lm.forward(seq)  # the prefill: more rows than the pack holds, so the stock kernel
            seq.crop_cache(len(context) - 1)  # the verify below feeds exactly n positions
            with packedgemm.disabled() if arm == "stock" else contextlib.nullcontext():
                logits[arm] = lm.forward(seq, list(range(10, 10 + n - 1)), keep=n)
        torch.testing.assert_close(logits["packed"], logits["stock"], atol=1e-4, rtol=1e-4)
        assert torch.equal(logits["packed"].argmax(-1), logits["stock"].argmax(-1))


def test_speculative_output_with_a_packed_target_equals_the_target_alone(pair):
    target, draft = pair
    model, _ = packed_copy(target, rows=8, min_rows=2)  # every verify of 2..8 positions takes the packed path
    loop = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(model, CPU))), LocalProposer(DraftEngine(ModelDrafter(CausalLM(draft, CPU)))),
                           CostModel(MODEL_DRAFT_PRIOR), MODEL_DRAFT_PRIOR)
    for prompt in tiny.prompts(4, seed=11):
        expected = tiny.reference_greedy(target, prompt, MAX_NEW)
        for gamma in (3, 7):
            assert run(loop, prompt, draft_length=gamma)[0] == expected


def test_apply_is_skipped_when_off_or_unavailable(pair):
    target, _ = pair
    model = copy.deepcopy(target)
    assert packedgemm.apply(model, CPU, torch.float32, 0, 1) is None
    assert packedgemm.apply(model, CPU, torch.bfloat16, 8, 5) is None
    assert not any(isinstance(m, packedgemm.PackedLinear) for m in model.modules())
    assert packedgemm.apply(model, CPU, torch.float32, 8, 5).layers > 0


@pytest.mark.parametrize("rows, min_rows", [(-1, 5), (8, 0), (8, 9)])
def test_target_config_rejects_bad_packed_rows(rows, min_rows):
    with pytest.raises(ValueError, match="packed-gemm"):
        TargetConfig(packed_gemm_rows=rows, packed_gemm_min_rows=min_rows)


def test_pack_linears_rejects_a_bad_range(pair):
    with pytest.raises(ValueError, match="min_rows"):
        packedgemm.pack_linears(copy.deepcopy(pair[0]), 4, 6)
