"""Distillation and the pruned-vocabulary draft, on tiny random models (no real weights needed).

- a short `specdec distill` run on a tiny target lowers the loss and writes a loadable draft folder
  that stores no embedding;
- the pruned head maps back to target ids exactly (-inf, hence p = 0, outside the kept vocabulary);
- greedy output through the three gRPC services with the pruned draft equals the target's own;
- sampled proposals never carry a token outside the kept vocabulary with p > 0.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
import torch
from safetensors import safe_open

from specdec.calls.request import ProposeCall
from draft_service.drafters.model import load_pruned_drafter
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from specdec_tools import distill
from specdec.model.pruned import WEIGHTS, PrunedDraft, load_draft
from tests import tiny
from tests.stack import Stack

KEPT = 160  # of the tiny vocabulary's 260 ids: plenty of tokens the draft cannot propose


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill")
    target, _ = tiny.tiny_pair(seed=0)
    target_path = tiny.save(target, folder / "target")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n\n".join(f"passage {i}: the quick brown fox jumps over the lazy dog, then naps." for i in range(120)))
    argv = ["--target-model", target_path, "--corpus", str(corpus), "--out", str(folder / "draft"), "--layers", "1",
            "--vocab", str(KEPT), "--gen-prompts", "16", "--gen-tokens", "24", "--corpus-tokens", "3000", "--seq-len", "48",
            "--steps", "200", "--batch", "8", "--lr", "3e-3", "--heldout-prompts", "4", "--eval-tokens", "24",
            "--checkpoint-every", "50", "--threads", "1", "--dtype", "float32"]
    report = distill.run(distill.parse_args(argv), "test")
    return {"report": report, "target": target, "target_path": target_path, "draft": folder / "draft", "argv": argv, "folder": folder}


def test_short_distillation_lowers_the_loss_and_reports(run):
    r = run["report"]
    assert r["loss_last"] < 0.8 * r["loss_first"]
    assert r["kept_vocab"] == KEPT
    for key in ("acceptance", "accepted_per_step", "draft_cost_c", "per_token_agreement"):
        assert r[key] >= 0
    assert 0 <= r["acceptance"] <= 1
    assert "acceptance" in distill.format_report(r)


def test_draft_folder_stores_no_embedding_and_loads(run):
    folder = run["draft"]
    with safe_open(str(folder / WEIGHTS), framework="pt") as fh:
        keys = list(fh.keys())  # noqa: SIM118
    assert "head.weight" in keys and not any("embed_tokens" in k for k in keys)
    assert len(json.loads((folder / "kept_vocab.json").read_text())) == KEPT
    model, meta = load_draft(folder)
    assert meta["target"] == run["target_path"]
    # The embedding is the target's, shared at load time.
    assert torch.equal(model.body.embed_tokens.weight, run["target"].model.embed_tokens.weight)


def test_resume_from_checkpoint_continues_where_it_stopped(run, tmp_path):
    """A finished run re-invoked with more steps trains only the new ones, from the saved state."""
    args = distill.parse_args([*run["argv"], "--steps", "210"])
    args.work_dir = str(pathlib.Path(run["argv"][run["argv"].index("--out") + 1]).with_suffix(".work"))
    args.out = str(tmp_path / "draft2")
    report = distill.run(args, "test")
    state = torch.load(pathlib.Path(args.work_dir) / "checkpoint.pt", weights_only=False)
    assert state["step"] == 210 and len(state["losses"]) == 210
    assert report["steps"] == 210


def test_data_made_with_other_settings_is_refused_not_mixed_in(run, tmp_path):
    """Shards are cached by batch index: another --gen-tokens in the same work dir must not
    silently reuse them. The refusal names what differs; the data stays."""
    args = distill.parse_args([*run["argv"], "--gen-tokens", "30"])
    args.work_dir = str(pathlib.Path(run["argv"][run["argv"].index("--out") + 1]).with_suffix(".work"))
    args.out = str(tmp_path / "draft3")
    with pytest.raises(ValueError, match=r"other settings \(tokens: 24 there, 30 now\)"):
        distill.run(args, "test")
    assert any((pathlib.Path(args.work_dir) / "gen").glob("shard_*.pt"))
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "shard_00000.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="no record of their settings"):
        distill.data_dir(stray, {"tokens": 1})


def test_pruned_head_maps_back_to_target_ids_exactly():
    config = tiny.tiny_config(layers=1)
    kept = [3, 7, 100, 255, 256]
    model = PrunedDraft(config, kept).eval()
    pruned = torch.randn(2, 5, len(kept))
    full = model.to_target_logits(pruned)
    assert full.shape == (2, 5, tiny.VOCAB)
    assert torch.equal(full[..., kept], pruned)
    outside = torch.ones(tiny.VOCAB, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(full[..., outside]).all()
    probs = torch.softmax(full, dim=-1)
    assert torch.equal(probs[..., outside], torch.zeros_like(probs[..., outside]))
    with pytest.raises(ValueError):
        PrunedDraft(config, [1, 1])
    with pytest.raises(ValueError):
        PrunedDraft(config, [tiny.VOCAB])


def test_out_of_vocabulary_tokens_get_probability_zero(run):
    drafter = load_pruned_drafter(run["draft"], "cpu", "float32", top_k=KEPT + 20)
    kept = set(json.loads((run["draft"] / "kept_vocab.json").read_text()))
    engine = DraftEngine(drafter)
    for i, prompt in enumerate(tiny.prompts(8)):
        for proposal in engine.propose(ProposeCall(f"s{i}", 0, prompt, 6, 0.0, 1.0, seed=i)):
            assert proposal.token in kept
            ids, probs = proposal.dist
            for token, p in zip(ids, probs):
                assert p == 0.0 or token in kept
            assert abs(sum(probs) - 1) < 1e-5


def test_missing_corpus_and_wrong_target_are_clear_errors(run, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        distill.load_corpus([str(tmp_path / "nope.txt")])
    assert distill.main(["--target-model", run["target_path"], "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    other = tiny.tiny_config(hidden=32)
    from transformers import LlamaForCausalLM

    wrong = tiny.save(LlamaForCausalLM(other), tmp_path / "wrong")
    with pytest.raises(ValueError, match="wrong target"):
        load_draft(run["draft"], target_override=wrong)


def test_simulated_acceptance_counts():
    assert distill.simulate_greedy([True] * 8, 4) == (2, 8, 7)  # 4 accepted + bonus, then 3 accepted to the end
    assert distill.simulate_greedy([False, True, True], 4) == (2, 8, 2)
    assert distill.simulate_greedy([], 4) == (0, 0, 0)


def test_greedy_through_the_services_equals_the_target(run):
    stack = Stack()
    try:
        target_addr = stack.target(run["target_path"])
        draft_addr = stack.draft(drafter="model", model=str(run["draft"]))
        client = stack.client(stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer()))
        drafted = accepted = 0
        for prompt in tiny.prompts(10):
            expected = tiny.reference_greedy(run["target"], prompt, 24)
            for draft_length in (1, 4):
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=24,
                                             speculation=pb.SpeculationParams(draft_length=draft_length, adaptive=False))
                response = client.Generate(request, timeout=60)
                assert list(response.token_ids) == expected
                drafted += response.stats.draft_tokens
                accepted += response.stats.accepted_tokens
        assert 0 < accepted < drafted  # speculation happened, with accepts and rejects
    finally:
        stack.stop()


def test_cli_is_registered():
    from specdec_tools.cli import COMMANDS

    assert "distill" in COMMANDS
    assert isinstance(distill.parse_args(["--out", "x"]), argparse.Namespace)


def test_evaluate_remeasures_the_stored_draft(run, capsys):
    """--evaluate re-reads the folder: same held-out prompts, same fp32 weights -> the training report's acceptance."""
    assert distill.main([*run["argv"], "--evaluate"]) == 0
    out = capsys.readouterr().out
    assert f"acceptance {run['report']['acceptance']:.3f}" in out and "c = " in out


def test_hf_assistant_wrapper_drafts_for_transformers_generate(run):
    """bench's hf-assisted[draft] runs transformers' assisted generation with this very draft."""
    from specdec.model.pruned import hf_assistant

    assistant = hf_assistant(run["draft"])
    calls = []
    assistant.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    target = run["target"]
    ours = target.generate(input_ids=ids, max_new_tokens=16, do_sample=False, assistant_model=assistant)
    alone = target.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    assert ours.tolist() == alone.tolist() and calls  # lossless, and the draft really drafted
    logits = assistant(input_ids=ids).logits[0, -1]
    kept = set(json.loads((run["draft"] / "kept_vocab.json").read_text()))
    assert all((logits[t] == float("-inf")) == (t not in kept) for t in range(logits.shape[0]))
