"""The real default target (SmolLM2-135M-Instruct, embedded GGUF): slow, a bounded set runs in CI."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from protos import specdec_pb2 as pb
from specdec.model.cpu import gemm
from specdec.model.loading import DEFAULT_TARGET, load_model
from tests.stack import Stack

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Summarise: The quick brown fox jumps over the lazy dog. The dog does not react. The fox runs away.",
]
# CI runs the first prompt of each (marker `ci`); `make test-all` runs them all.
BOUNDED = [pytest.param(p, marks=pytest.mark.ci) if i == 0 else p for i, p in enumerate(PROMPTS)]
MAX_NEW = 40


@pytest.fixture(scope="module")
def real():
    loaded = load_model(DEFAULT_TARGET, device="cpu")
    # the target alone as the service computes it: specdec's kernel and row-exact attention
    gemm.apply(loaded.model, loaded.device, loaded.dtype, gemm.DEFAULT_ROWS, gemm.DEFAULT_MIN_ROWS, "fp32", loaded.path)
    stack = Stack()
    target = stack.target(DEFAULT_TARGET, weights="fp32")  # generate()'s tokens, which the reference computes
    draft = stack.draft(drafter="ngram")
    client = stack.client(stack.coordinator(target, draft, loaded.tokenizer))
    yield loaded, client
    stack.stop()


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def target_alone(loaded, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
    expected = out[0, len(ids):].tolist()
    eos = set(loaded.model.generation_config.eos_token_id if isinstance(loaded.model.generation_config.eos_token_id, list) else [loaded.model.generation_config.eos_token_id])
    for i, token in enumerate(expected):
        if token in eos:
            return expected[: i + 1]
    return expected


@pytest.mark.parametrize("prompt", BOUNDED)
def test_greedy_equals_target_alone_with_ngram_draft(real, prompt):
    loaded, client = real
    ids = chat_ids(loaded.tokenizer, prompt)
    expected = target_alone(loaded, ids)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW)
    response = client.Generate(request, timeout=300)
    assert list(response.token_ids) == expected
    assert response.stats.steps <= len(expected)


@pytest.fixture(scope="module")
def real_feature_draft(real):
    from specdec.model.loading import feature_draft_folder

    if feature_draft_folder("smollm2-135m-feature") is None:
        pytest.skip("no committed feature draft in specdec/drafts/smollm2-135m-feature")
    loaded, _ = real
    stack = Stack()
    target = stack.target(DEFAULT_TARGET, weights="fp32")
    draft = stack.draft(drafter="model", model="smollm2-135m-feature")
    yield loaded, stack.client(stack.coordinator(target, draft, loaded.tokenizer))
    stack.stop()


@pytest.mark.parametrize("prompt", BOUNDED)
def test_greedy_equals_target_alone_with_the_committed_feature_draft(real_feature_draft, prompt):
    """The target's hidden states travel Verify -> coordinator -> Propose for real; the output is unchanged."""
    loaded, client = real_feature_draft
    ids = chat_ids(loaded.tokenizer, prompt)
    expected = target_alone(loaded, ids)
    for draft_length in (2, 4):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                                     speculation=pb.SpeculationParams(draft_length=draft_length, adaptive=False))
        response = client.Generate(request, timeout=300)
        assert list(response.token_ids) == expected
        assert response.stats.draft_tokens > 0 and response.stats.accepted_tokens > 0


def free_port_block(size: int = 3) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + size < 65535 and all(_port_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free block of ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_specdec_up_and_generate_cli(tmp_path):
    """The README's main job: `specdec up`, then `specdec generate`, on the embedded default models (gguf-a8 on
    a CPU with VNNI: the question is one whose first token is no near-tie between formats)."""
    port = free_port_block()
    up = subprocess.Popen([sys.executable, "-m", "specdec_tools.cli", "up", "--port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    try:
        result = subprocess.run(
            [sys.executable, "-m", "specdec_tools.cli", "generate", "--address", f"127.0.0.1:{port}", "--wait", "300",
             "--max-new-tokens", "48", "--compare", "Which planet is the largest in our solar system?"],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Jupiter" in result.stdout, result.stdout
        assert "identical tokens: yes" in result.stderr, result.stderr
        assert re.search(r"\d+ tokens in [\d.]+s", result.stderr)
    finally:
        up.terminate()
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
    assert up.returncode == 0
