"""The model interface (specdec/model/interface.py, issue 58 item 1): every implementation declares
every member of the protocol, `load_lm` assembles a model as the services serve it, and each forward
is held to the simplest one, transformers' (CausalLM over the unpacked model).
"""

from __future__ import annotations

import typing

import pytest
import torch

from specdec.kv.store import Sequence
from specdec.model.cpu import gemm, stack
from specdec.model import interface
from specdec.model.assembly import LMOptions, load_lm
from specdec.model.interface import LanguageModel, ModelDescription
from specdec.model.lm import CausalLM
from specdec.model.pruned import PrunedCausalLM, PrunedDraft
from specdec.model.gpu.static import StaticLM
from tests import tiny

CPU = torch.device("cpu")


def _implementations():
    target, _ = tiny.tiny_pair()
    pruned = PrunedDraft(tiny.tiny_config(layers=2), kept_ids=list(range(0, tiny.VOCAB, 3))).eval()
    return {"transformers": CausalLM(target, CPU), "static": StaticLM(target, CPU, pass_rows=16, slots=4),
            "pruned": PrunedCausalLM(pruned, CPU, [tiny.EOS])}


def test_the_member_lists_are_the_protocols():
    """DESCRIPTION_MEMBERS and LM_MEMBERS name exactly what the protocols declare (readers and the
    checks below go by the lists)."""
    def declared(protocol) -> set[str]:
        names = set()
        for cls in protocol.__mro__:
            if cls in (typing.Protocol, typing.Generic, object):
                continue
            names |= set(cls.__dict__.get("__annotations__", {}))
            names |= {n for n, v in cls.__dict__.items() if callable(v) or isinstance(v, property)} - {"__init__", "_is_protocol"}
        return {n for n in names if not n.startswith("_")}

    assert declared(ModelDescription) == set(interface.DESCRIPTION_MEMBERS)
    assert declared(LanguageModel) == set(interface.LM_MEMBERS)


@pytest.mark.parametrize("kind", ["transformers", "static", "pruned"])
def test_every_implementation_declares_every_member(kind):
    lm = _implementations()[kind]
    assert isinstance(lm, LanguageModel)
    missing = [name for name in interface.LM_MEMBERS if not hasattr(lm, name)]
    assert not missing
    assert lm.fixed_shape == (kind == "static")
    assert lm.max_sequences == (4 if kind == "static" else None)
    assert lm.dtype_name == "float32" and lm.device == CPU and lm.vocab_size == tiny.VOCAB
    assert lm.capturing is False and lm.full_attention_cache()


def test_a_feature_drafts_lm_is_a_description():
    from draft_service.drafters.feature import FeatureDrafter

    drafter = FeatureDrafter(tiny.feature_draft_of(tiny.one_layer_target()), CPU, [tiny.EOS])
    assert isinstance(drafter.lm, ModelDescription) and drafter.lm.max_sequences is None


def test_causal_lm_serves_transformers_models_only():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        CausalLM(torch.nn.Linear(2, 2), CPU)


def test_the_pruned_draft_maps_to_the_target_vocabulary():
    lm = _implementations()["pruned"]
    full = lm.to_target_logits(torch.zeros(1, len(lm.model.kept_ids)))
    assert full.shape == (1, tiny.VOCAB) and torch.isinf(full).sum() == tiny.VOCAB - len(lm.model.kept_ids)


def _chain_logits(lm, prompt: list[int], steps: int) -> torch.Tensor:
    """A prompt, then `steps` greedy tokens one forward each: every position's logits, [n, V]."""
    seq = Sequence("s", list(prompt))
    rows = [lm.forward(seq, keep=len(prompt))]
    for _ in range(steps):
        seq.tokens.append(int(rows[-1][-1].argmax()))
        rows.append(lm.forward(seq))
    return torch.cat(rows)


def test_load_lm_serves_a_model_as_the_target_does_and_agrees_with_transformers(tmp_path):
    """load_lm: load, pack with the kernel, a CausalLM on the CPU; its logits are transformers' own
    forward's over the same weights (another summation order: close, and the same tokens)."""
    if not gemm.available(CPU, torch.float32):
        pytest.skip("no C compiler: the kernel is not available here")
    target, _ = tiny.tiny_pair()
    served = load_lm(LMOptions(model=tiny.save(target, tmp_path / "target"), device="cpu"))
    assert type(served.lm) is CausalLM and served.packed is not None and served.weights == "fp32"
    assert served.numerics == "exact"  # the kernel's products and its row-exact attention
    assert served.weight_bytes == served.packed.weight_bytes and not stack.applies(served.lm)
    prompt = tiny.prompts(1)[0]
    ours, theirs = _chain_logits(served.lm, prompt, 8), _chain_logits(CausalLM(target, CPU), prompt, 8)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_load_lm_with_compact_weights_picks_the_one_call_stack(tmp_path):
    """Compact weights give a Llama the lean layer and the C stack at load (gemm.apply), which
    CausalLM then takes for chains; tests/test_decoder_stack.py holds it to the lean layer's bits."""
    if not gemm.available(CPU, torch.float32):
        pytest.skip("no C compiler: the kernel is not available here")
    target, _ = tiny.tiny_pair()
    served = load_lm(LMOptions(model=tiny.save(target, tmp_path / "target"), device="cpu", weights="int8"))
    assert served.weights == "int8" and stack.applies(served.lm)
    assert _chain_logits(served.lm, tiny.prompts(1)[0], 4).shape == (len(tiny.prompts(1)[0]) + 4, tiny.VOCAB)


def test_load_lm_without_the_kernel_packs_nothing(tmp_path):
    target, _ = tiny.tiny_pair()
    served = load_lm(LMOptions(model=tiny.save(target, tmp_path / "target"), device="cpu", packed_gemm_rows=0))
    assert served.packed is None and served.weights == "float32"
    assert served.numerics == "fast"  # stock kernels: ModelInfo and /v1/models say so
    assert served.weight_bytes == gemm.linear_bytes(served.loaded.model)


def test_the_static_forward_agrees_with_transformers():
    """StaticLM's passes of one shape (the CPU's torch attention loop) against CausalLM on the same model."""
    target, _ = tiny.tiny_pair()
    prompt = tiny.prompts(2)[1]
    ours = _chain_logits(StaticLM(target, CPU, pass_rows=16, slots=2), prompt, 8)
    theirs = _chain_logits(CausalLM(target, CPU), prompt, 8)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
