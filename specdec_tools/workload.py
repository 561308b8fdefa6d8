"""What the tools run and what they check it against: the prompt sets, and the target decoding alone.

Prompt sets are package data (specdec_tools/prompts/NAME.jsonl: one {"id", "messages"} per line),
so an installed wheel can run `specdec bench` and `specdec loadtest`; a .jsonl path of the same
shape works too. The reference is transformers' greedy generate() on the target, as users run it:
greedy speculation must reproduce it token for token.
"""

from __future__ import annotations

import json
import pathlib

PROMPT_SETS = ("chat", "grounded")
PROMPTS_DIR = pathlib.Path(__file__).resolve().parent / "prompts"  # package data: an installed wheel has them


def prompt_path(prompts: str) -> pathlib.Path:
    """The file of a prompt set: NAME (specdec_tools/prompts/NAME.jsonl) or a .jsonl path."""
    path = pathlib.Path(prompts)
    return path if path.suffix == ".jsonl" else PROMPTS_DIR / f"{prompts}.jsonl"


def load_prompts(tokenizer, prompts: str, limit: int) -> list[tuple[str, list[int]]]:
    """(id, token ids through the chat template) of the first `limit` prompts (0: all) of a set."""
    path = prompt_path(prompts)
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {path.stem!r}: {path} not found (sets: {', '.join(PROMPT_SETS)})"
                                if path.parent == PROMPTS_DIR else f"{path} not found")
    out = []
    for index, line in enumerate(path.read_text().splitlines()[: limit or None]):
        item = json.loads(line)
        ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append((item.get("id", str(index)), list(ids)))
    return out


def load_prompt_ids(tokenizer, prompts: str, limit: int) -> list[list[int]]:
    """load_prompts without the ids."""
    return [ids for _, ids in load_prompts(tokenizer, prompts, limit)]


def greedy_generate(model, prompt: list[int], max_new: int, eos: list[int], packed: bool = False, **generate_kwargs) -> list[int]:
    """transformers' greedy generate() of one prompt's continuation, as users run it (specdec's
    packed layers off, so the fp32 weights): the target decoding alone; with generate_kwargs
    (assistant_model=, prompt_lookup_num_tokens=), transformers' own assisted generation.
    `packed`: through specdec's packed layers instead, the model in their weight format."""
    import contextlib

    import torch

    from specdec.model.cpu import gemm

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode(), contextlib.nullcontext() if packed else gemm.disabled():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0] if eos else None, **generate_kwargs)
    return out[0, len(prompt):].tolist()


def reference_outputs(target: str, prompts: list[list[int]], max_new: int, weights: str = "fp32",
                      device: str = "cpu") -> list[list[int]]:
    """The target decoding alone on every prompt, up to its first end-of-sequence token: the ground
    truth. `weights`: the format the target serves (the reference is the model in that format).
    On a GPU the reference is the target engine with speculation off, in the exact numerics the
    service runs (transformers' generate() computes other bits there: specdec/model/gpu/static.py)."""
    from specdec.model.assembly import LMOptions, load_lm

    if device != "cpu":
        return engine_outputs(target, prompts, max_new, device)
    # the model as the target service computes it (its kernel and row-exact attention, fp32 included)
    served = load_lm(LMOptions(model=target, device="cpu", weights=weights))
    eos = served.lm.eos_token_ids
    out = []
    for prompt in prompts:
        new = greedy_generate(served.loaded.model, prompt, max_new, eos, packed=True)
        cut = next((i for i, t in enumerate(new) if t in eos), None)
        out.append(new[: cut + 1] if cut is not None else new)
    return out


def engine_outputs(target: str, prompts: list[list[int]], max_new: int, device: str) -> list[list[int]]:
    """The target service's engine decoding alone (one Verify without draft tokens per token), as
    `specdec serve target --device DEVICE` computes it; cut after the first end-of-sequence token."""
    from specdec.model.assembly import LMOptions, load_lm
    from specdec.calls.request import VerifyCall
    from specdec.maths.sampling import SamplingConfig
    from target_service.engine import TargetEngine

    engine = TargetEngine(load_lm(LMOptions(model=target, device=device, packed_gemm_rows=0)).lm)  # a GPU packs nothing
    out = []
    for number, prompt in enumerate(prompts):
        tokens, known, name = list(prompt), 0, f"reference-{number}"
        while len(tokens) - len(prompt) < max_new and not (len(tokens) > len(prompt) and tokens[-1] in engine.lm.eos_token_ids):
            result = engine.verify(VerifyCall(name, known, tokens[known:], [], [], SamplingConfig()))
            tokens.append(result.next_token)
            known = result.cached_len
        engine.store.release(name)
        out.append(tokens[len(prompt):])
    return out
