"""The real cross-tokenizer pair, both ways: SmolLM2-135M-Instruct (byte-level BPE, 49,152 tokens)
and Gemma-3-270M (sentencepiece-style, 262,144 tokens). Slow: loads both models twice.

Greedy output must equal the target alone (speculation off, same stack); acceptance is printed.
"""

from __future__ import annotations

import pytest

from protos import specdec_pb2 as pb
from specdec.model.loading import load_tokenizer
from tests.stack import Stack

pytestmark = pytest.mark.slow

SMOL, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
PROMPTS = [
    "The capital of France is",
    "def square(x):\n    return",
    "Grüße aus München! 東京 😀 — the weather today is",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def stacks():
    stack = Stack()
    out = {}
    for target, draft in ((SMOL, GEMMA), (GEMMA, SMOL)):
        tokenizer = load_tokenizer(target)
        target_addr = stack.target(target)
        draft_addr = stack.draft(drafter="model", model=draft, target_tokenizer=target)
        out[target] = (tokenizer, stack.client(stack.coordinator(target_addr, draft_addr, tokenizer)),
                       stack.client(stack.coordinator(target_addr, "", tokenizer)))
    yield out
    stack.stop()


@pytest.mark.parametrize("target", [SMOL, GEMMA])
def test_greedy_cross_tokenizer_draft_equals_target_alone(stacks, target):
    tokenizer, spec, alone = stacks[target]
    drafted = accepted = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW,
                                     speculation=pb.SpeculationParams(draft_length=4, adaptive=False))
        expected = alone.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW), timeout=600)
        got = spec.Generate(request, timeout=600)
        assert list(got.token_ids) == list(expected.token_ids), prompt
        drafted += got.stats.draft_tokens
        accepted += got.stats.accepted_tokens
    print(f"target {target}, draft {GEMMA if target == SMOL else SMOL}: accepted {accepted} of {drafted} "
          f"({accepted / max(drafted, 1):.2f})")
    assert drafted > 0 and accepted > 0
