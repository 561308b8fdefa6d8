"""specdec's small-M GEMM kernel for target forwards (specdec/model/cpu/gemm_kernel.py, specdec/model/cpu/gemm.py):
the same results as the stock kernel, rows that do not interact, the same tokens."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from specdec.maths.costs import MODEL_DRAFT_PRIOR, CostModel
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from specdec.model.cpu import gemm
from specdec.model.cpu import gemm_kernel
from specdec.kv.store import Sequence
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from specdec.calls.request import VerifyCall
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests import tiny
from tests.test_loop import MAX_NEW, run

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not gemm.available(CPU, torch.float32), reason="no C compiler to build the small-M kernel")


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=3)


def packed_copy(model, rows=16, min_rows=1):
    model = copy.deepcopy(model)
    report = gemm.pack_linears(model, rows, min_rows)
    return model, report


@pytest.mark.parametrize("out_features, in_features, bias", [(80, 48, True), (16, 16, False), (37, 5, True), (1, 64, False)])
def test_the_kernel_matches_the_stock_linear_for_every_row_count(out_features, in_features, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    kernel = gemm_kernel.load()
    panels = kernel.pack(linear.weight)
    assert panels.data_ptr() % gemm_kernel.ALIGNMENT == 0
    for m in [*range(1, 34), 48, 64, 100]:  # 1-16 rows in one group; more in groups of 16 per panel
        x = torch.randn(m, in_features)
        out = kernel.linear(x, panels, out_features, linear.bias)
        torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)


def test_the_kernel_refuses_what_it_cannot_compute():
    kernel = gemm_kernel.load()
    panels = kernel.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="rows"):
        kernel.linear(torch.randn(0, 4), panels, 8, None)
    with pytest.raises(ValueError, match="float32"):
        kernel.linear(torch.randn(2, 4, dtype=torch.float64), panels, 8, None)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    # What keeps a verify pass's logits equal to a decode step's: bit-identical, not merely close.
    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 200)
    kernel = gemm_kernel.load()
    panels = kernel.pack(linear.weight)
    x = torch.randn(40, 96)  # three groups of rows: 16, 16 and 8
    together = kernel.linear(x, panels, 200, linear.bias)
    for m in range(40):
        assert torch.equal(kernel.linear(x[m:m + 1], panels, 200, linear.bias)[0], together[m])
    assert torch.equal(kernel.linear(x[3:12], panels, 200, linear.bias), together[3:12])
    assert torch.equal(kernel.linear(x[5:37], panels, 200, linear.bias), together[5:37])
    assert torch.equal(kernel.linear(torch.cat([x[:5], torch.randn(4, 96)]), panels, 200, linear.bias)[:5], together[:5])


def test_a_packed_layer_uses_the_kernel_in_range_and_the_stock_one_outside():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    layer = gemm.PackedLinear(linear, rows=8, min_rows=3, kernel=gemm_kernel.load())
    for n in range(1, 12):
        x = torch.randn(1, n, 48)
        out = layer(x)
        assert out.shape == (1, n, 80)
        if 3 <= n <= 8:
            assert torch.equal(out[0], layer.kernel.linear(x[0], layer.packed, 80, layer.bias))
            torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
        else:  # outside the range the stock kernel runs: bit-identical
            assert torch.equal(out, linear(x))


def test_disabled_runs_the_stock_kernel():
    linear = torch.nn.Linear(32, 40)
    layer = gemm.PackedLinear(linear, rows=4, min_rows=1, kernel=gemm_kernel.load())
    x = torch.randn(3, 32)
    packed = layer.kernel.linear(x, layer.packed, 40, layer.bias)
    with gemm.disabled():
        assert torch.equal(layer(x), linear(x))
    assert torch.equal(layer(x), packed)  # back on after the block


def test_gradients_take_the_stock_kernel():
    linear = torch.nn.Linear(8, 8)
    layer = gemm.PackedLinear(linear, rows=4, min_rows=1, kernel=gemm_kernel.load())
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


def test_packing_keeps_the_models_parameters_ties_and_state_dict(pair):
    target, _ = pair
    tied = copy.deepcopy(target)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    keys = list(tied.state_dict())
    report = gemm.pack_linears(tied, 8, 5)
    assert report.layers == sum(isinstance(m, gemm.PackedLinear) for m in tied.modules()) > 0
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert list(tied.state_dict()) == keys
    assert not any(type(m) is torch.nn.Linear for m in tied.modules())


def test_verify_logits_agree_with_the_stock_path_and_with_decode(pair):
    target, _ = pair
    model, _ = packed_copy(target, rows=gemm.DEFAULT_ROWS)
    lm = CausalLM(model, CPU)
    context = tiny.prompts(1, seed=4)[0]
    for n in (1, 4, 5, 8, 9, 16, 17, 40):  # past 16 rows the kernel goes through each panel in groups
        logits = {}
        for arm in ("stock", "packed"):
            seq = Sequence(arm, tokens=list(context))
            lm.forward(seq)  # the prefill, the same in both arms
            seq.crop_cache(len(context) - 1)  # the verify below feeds exactly n positions
            with gemm.disabled() if arm == "stock" else contextlib.nullcontext():
                logits[arm] = lm.forward(seq, list(range(10, 10 + n - 1)), keep=n)
        torch.testing.assert_close(logits["packed"], logits["stock"], atol=1e-4, rtol=1e-4)
        assert torch.equal(logits["packed"].argmax(-1), logits["stock"].argmax(-1))


def test_a_prefill_through_the_kernel_agrees_with_the_stock_one_and_decodes_the_same(pair):
    target, _ = pair
    model, _ = packed_copy(target, rows=gemm.DEFAULT_ROWS)
    lm = CausalLM(model, CPU)
    prompt = tiny.prompts(1, seed=8)[0] * 3  # well past 16 positions in one forward
    logits = {}
    for arm in ("stock", "packed"):
        with gemm.disabled() if arm == "stock" else contextlib.nullcontext():
            logits[arm] = lm.forward(Sequence(arm, tokens=list(prompt)), keep=len(prompt))
    torch.testing.assert_close(logits["packed"], logits["stock"], atol=1e-4, rtol=1e-4)
    assert torch.equal(logits["packed"].argmax(-1), logits["stock"].argmax(-1))
    engine = TargetEngine(CausalLM(model, CPU))  # and greedy decoding after a kernel prefill is the target's own
    out, tokens = engine.verify(VerifyCall("p", 0, prompt, [], [], SamplingConfig())), []
    tokens.append(out.next_token)
    for _ in range(MAX_NEW - 1):
        out = engine.verify(VerifyCall("p", len(prompt) + len(tokens) - 1, tokens[-1:], [], [], SamplingConfig()))
        tokens.append(out.next_token)
    expected = tiny.reference_greedy(target, prompt, MAX_NEW)
    assert tokens[:len(expected)] == expected


def test_speculative_output_with_a_packed_target_equals_the_target_alone(pair):
    target, draft = pair
    model, _ = packed_copy(target)  # decode steps and every verify take the kernel
    loop = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(model, CPU))), LocalProposer(DraftEngine(ModelDrafter(CausalLM(draft, CPU)))),
                           CostModel(MODEL_DRAFT_PRIOR), MODEL_DRAFT_PRIOR)
    for prompt in tiny.prompts(4, seed=11):
        expected = tiny.reference_greedy(target, prompt, MAX_NEW)
        for gamma in (3, 7, 15):
            assert run(loop, prompt, draft_length=gamma)[0] == expected


def test_apply_is_skipped_when_off_or_unavailable(pair):
    target, _ = pair
    model = copy.deepcopy(target)
    assert gemm.apply(model, CPU, torch.float32, 0, 1) is None
    assert gemm.apply(model, CPU, torch.bfloat16, 8, 5) is None
    assert not any(isinstance(m, gemm.PackedLinear) for m in model.modules())
    assert gemm.apply(model, CPU, torch.float32, 8, 5).layers > 0


def test_no_compiler_means_no_kernel_and_a_stock_model(pair, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    gemm_kernel.load.cache_clear()
    try:
        assert gemm_kernel.load() is None
        assert not gemm.available(CPU, torch.float32)
        model = copy.deepcopy(pair[0])
        assert gemm.apply(model, CPU, torch.float32, 8, 1) is None
        assert not any(isinstance(m, gemm.PackedLinear) for m in model.modules())
    finally:
        gemm_kernel.load.cache_clear()


@pytest.mark.slow  # test-all: the suite's time (issue 58); a full compile; every other kernel test compiles through the shared cache
def test_a_fresh_cache_compiles_the_kernel_once(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    gemm_kernel.load.cache_clear()
    try:
        kernel = gemm_kernel.load()
        assert kernel is not None and kernel.path.parent == tmp_path / "kernels"
        built = kernel.path.stat().st_mtime_ns
        gemm_kernel.load.cache_clear()
        assert gemm_kernel.load().path == kernel.path and kernel.path.stat().st_mtime_ns == built
        assert [p.name for p in (tmp_path / "kernels").iterdir()] == [kernel.path.name]  # no temporary left behind
    finally:
        gemm_kernel.load.cache_clear()


@pytest.mark.parametrize("rows, min_rows", [(-1, 5), (8, 0), (8, 9), (gemm.MAX_ROWS + 1, 1)])
def test_target_config_rejects_bad_packed_rows(rows, min_rows):
    with pytest.raises(ValueError, match="packed-gemm"):
        TargetConfig(packed_gemm_rows=rows, packed_gemm_min_rows=min_rows)


def test_pack_linears_rejects_a_bad_range(pair):
    with pytest.raises(ValueError, match="min_rows"):
        gemm.pack_linears(copy.deepcopy(pair[0]), 4, 6)
    with pytest.raises(ValueError, match="min_rows"):
        gemm.pack_linears(copy.deepcopy(pair[0]), gemm.MAX_ROWS + 1, 1)


def test_weights_auto_picks_the_gguf_blocks_of_a_gguf_model_against_int8_activations_where_the_cpu_has_vnni(tmp_path, monkeypatch):
    """The services' default: the fastest exact format where the kernel can serve it, else fp32."""
    import json

    if not gemm.available(CPU, torch.float32):
        pytest.skip("no C compiler for the kernel")
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    from_gguf = tmp_path / "converted"
    from_gguf.mkdir()
    (from_gguf / "specdec_source.json").write_text(json.dumps({"gguf": str(gguf_file)}))
    monkeypatch.setattr(gemm, "int8_dot_products", lambda: True)
    assert gemm.resolve_weights("auto", CPU, torch.float32, 8, str(from_gguf)) == "gguf-a8"
    assert gemm.resolve_weights("auto", CPU, torch.float32, 8, str(tmp_path)) == "fp32"  # not from a GGUF
    assert gemm.resolve_weights("auto", CPU, torch.float32, 0, str(from_gguf)) == "fp32"  # kernel off
    assert gemm.resolve_weights("auto", torch.device("cuda"), torch.float32, 8, str(from_gguf)) == "fp32"
    assert gemm.resolve_weights("q4", CPU, torch.float32, 8, str(tmp_path)) == "q4"  # asked for: as asked
    monkeypatch.setattr(gemm, "int8_dot_products", lambda: False)
    assert gemm.resolve_weights("auto", CPU, torch.float32, 8, str(from_gguf)) == "gguf"


def test_weights_auto_on_a_model_not_from_gguf_serves_fp32(pair):
    if not gemm.available(CPU, torch.float32):
        pytest.skip("no C compiler for the kernel")
    report = gemm.apply(copy.deepcopy(pair[0]), CPU, torch.float32, 8, 1, "auto", None)
    assert report.weights == "fp32" and report.layers > 0
