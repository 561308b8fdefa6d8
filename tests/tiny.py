"""Test helpers over the tiny models of specdec_tools.tinymodels: prompts and the reference decoder."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from specdec_tools.tinymodels import EOS, VOCAB, byte_tokenizer, save, tiny_config, tiny_pair

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


def feature_draft_of(target: LlamaForCausalLM, kept: list[int] | None = None, noise: float = 0.0, seed: int = 0):
    """A feature draft (specdec/model/feature_draft.py) that nearly reproduces a ONE-layer target: fc passes the
    token's embedding through, the layer and norm are the target's, so its predicted feature is
    the target's own up to the missing first position in attention. High but imperfect acceptance
    (and `noise` lowers it) exercises acceptance, rejection and bonus tokens alike."""
    from specdec.model.feature_draft import FeatureDraft

    config = target.config
    if config.num_hidden_layers != 1:
        raise ValueError("feature_draft_of copies a one-layer target")
    kept = list(range(config.vocab_size)) if kept is None else kept
    draft = FeatureDraft(config, kept, config.vocab_size)
    hidden = config.hidden_size
    with torch.no_grad():
        draft.embed.weight.copy_(target.model.embed_tokens.weight)
        draft.body.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.body.norm.weight.copy_(target.model.norm.weight)
        draft.head.weight.copy_(target.lm_head.weight[torch.tensor(kept)])
        draft.fc.weight.zero_()
        draft.fc.weight[:, :hidden] = torch.eye(hidden)
        draft.fc.bias.zero_()
        gen = torch.Generator().manual_seed(seed)
        for param in draft.body.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std().clamp(min=1e-3))
    return draft.eval()


def long_context_target(layers: int = 1, context: int = 8192, seed: int = 0) -> LlamaForCausalLM:
    """A tiny target whose context holds prompts of thousands of tokens."""
    torch.manual_seed(seed)
    config = tiny_config(layers=layers)
    config.max_position_embeddings = context
    return LlamaForCausalLM(config).eval()


def one_layer_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(layers=1)).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    return model


def looping_target(layers: int = 2, hidden: int = 512, seed: int = 0) -> LlamaForCausalLM:
    """A target whose greedy text soon loops, so prompt lookup (the n-gram drafter) is right nearly
    always once a loop has begun: its attention outputs are zeroed, so each next token depends on
    the current token alone. Wider than the other tiny models, so that a forward's cost grows with
    the positions it computes (a batch padded to a prefill costs far more than one token), as a
    real target's does; at width 64 the Python around the forward dominates."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(layers=layers, hidden=hidden)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    return model
