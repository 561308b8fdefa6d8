"""Tiny randomly initialised models and a byte-level tokenizer, built from configs: no downloads.

For the tests (correctness needs no real weights) and for `specdec bench --quick`, which runs the
whole benchmark pipeline in CI in a minute. The draft is the target with noise added to its weights,
so it agrees with the target often but not always, which exercises acceptance, rejection,
correction and bonus tokens alike.
"""

from __future__ import annotations

import pathlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = 256
VOCAB = 260  # 256 byte tokens, <eos>, and padding rows


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A real byte-level BPE tokenizer with no merges: one token per byte, plus <eos>."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    return fast


def tiny_config(layers: int = 2, hidden: int = 64) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2,  # peaky logits: varied greedy text, few near-ties
        eos_token_id=EOS, pad_token_id=EOS, bos_token_id=0, tie_word_embeddings=False,
    )


def tiny_pair(seed: int = 0, noise: float = 0.08) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(target, draft): the draft is the target plus Gaussian noise of relative size `noise`."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_config()).eval()
    draft = LlamaForCausalLM(tiny_config()).eval()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std().clamp(min=1e-3))
    for model in (target, draft):
        model.generation_config.eos_token_id = EOS
        model.generation_config.pad_token_id = EOS
    return target, draft


def save(model: LlamaForCausalLM, folder: pathlib.Path) -> str:
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


# The shapes of real checkpoints, for exactness and speed on a GPU without carrying their weights.
REAL_SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
}


def real_shape(name: str, seed: int = 0, initializer_range: float = 0.02) -> LlamaForCausalLM:
    """A model of a real checkpoint's shape (REAL_SHAPES: SmolLM2-135M, a Llama-3.2-1B) with seeded
    random weights. Its logits are nearly flat, so greedy decoding meets near-ties at every step: a
    hard case for exactness. The weights are drawn on the CPU, so a seed gives the same model on
    every machine."""
    torch.manual_seed(seed)
    config = LlamaConfig(initializer_range=initializer_range, **REAL_SHAPES[name])
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> None:
    """`python -m specdec_tools.tinymodels OUT`: a tiny random target saved as a model folder (byte
    tokenizer included), for load tests whose subject is the serving path, not the model: e.g. a
    flood of long prompts (`--context 4096`) that a real model would take hours to prefill here."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m specdec_tools.tinymodels", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("out", help="Folder to write the model and tokenizer to.")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="max_position_embeddings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    config = tiny_config(layers=args.layers, hidden=args.hidden)
    config.max_position_embeddings = args.context
    print(save(LlamaForCausalLM(config).eval(), pathlib.Path(args.out)))


if __name__ == "__main__":
    main()
