"""Test helpers over the tiny models of specdec.tinymodels: prompts and the reference decoder."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from specdec.tinymodels import EOS, VOCAB, byte_tokenizer, save, tiny_config, tiny_pair

__all__ = ["EOS", "VOCAB", "byte_tokenizer", "save", "tiny_config", "tiny_pair", "prompts", "reference_greedy"]


def prompts(count: int = 20, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of varied lengths (3..40), some with repeats for the n-gram drafter."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = int(torch.randint(3, 40, (1,), generator=gen))
        ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        if i % 3 == 0:
            ids = ids + ids[: length // 2]  # repeated content: something for prompt lookup to find
        out.append(ids)
    return out


@torch.inference_mode()
def reference_greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target decoding alone with transformers' own generate(): the ground truth."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new
