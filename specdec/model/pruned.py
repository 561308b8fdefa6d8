"""A draft model with a pruned-vocabulary head that shares its input embeddings with the target.

Why this shape: on a CPU the output layer dominates a small draft (a 49,152-row head costs more
than two transformer layers of SmolLM2's width), so the head scores only
the N most frequent target tokens; every other token gets draft probability 0, which rejection
sampling handles losslessly (the target's residual distribution covers it). The input embedding is
the target's own matrix, read from the target's safetensors at load time, so the draft folder stores
only what is its own (a few MB) and can never drift from the target's vocabulary.

Folder format (written by `save_draft`, read by `load_draft`):
    specdec_draft.json   {"format": 1, "target": <target spec>, "target_vocab_size": V,
                          "llama_config": {...}, "eos_token_ids": [...]}
    kept_vocab.json      the N kept target token ids, in head-row order
    model.safetensors    body weights (no embed_tokens) and head.weight [N, hidden]
    README.md            the model card (for committed drafts)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, LlamaConfig, LlamaModel

from specdec.model.draft_folders import PRUNED_MARKER, is_pruned_draft
from specdec.model.hfcache import cache_kwargs, output_field, returned_cache
from specdec.model.loading import resolve_model_path
from specdec.kv.buffers import full_attention, new_cache
from specdec.kv.store import Sequence

MARKER = PRUNED_MARKER
KEPT = "kept_vocab.json"
WEIGHTS = "model.safetensors"
EMBED_KEY = "embed_tokens.weight"


@dataclasses.dataclass
class DraftOutput:
    logits: torch.Tensor  # [B, T, N] over the kept vocabulary
    past_key_values: DynamicCache | None


class PrunedDraft(torch.nn.Module):
    """Llama body (embeddings = the target's, frozen) + a head over the kept token ids only."""

    def __init__(self, config: LlamaConfig, kept_ids: list[int]):
        super().__init__()
        if len(set(kept_ids)) != len(kept_ids) or not kept_ids:
            raise ValueError("kept_ids must be a non-empty list of distinct target token ids")
        if min(kept_ids) < 0 or max(kept_ids) >= config.vocab_size:
            raise ValueError(f"kept_ids must lie in the target vocabulary [0, {config.vocab_size})")
        self.config = config
        self.body = LlamaModel(config)
        self.head = torch.nn.Linear(config.hidden_size, len(kept_ids), bias=False)
        self.register_buffer("kept_ids", torch.tensor(kept_ids, dtype=torch.long), persistent=False)

    @property
    def target_vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, past_key_values: DynamicCache | None = None, use_cache: bool = False,
                logits_to_keep: int = 0, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> DraftOutput:
        out = self.body(input_ids=input_ids, **cache_kwargs(self.body, past_key_values), use_cache=use_cache,
                        attention_mask=attention_mask, position_ids=position_ids)  # explicit: tree drafts
        hidden = out.last_hidden_state  # [B, T, H]
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return DraftOutput(self.head(hidden), returned_cache(out) if use_cache else None)

    def to_target_logits(self, pruned: torch.Tensor) -> torch.Tensor:
        """[..., N] pruned logits -> [..., V] target-vocabulary logits, -inf outside the kept ids.

        -inf (not a large negative number) makes the draft's p exactly 0 there after softmax, so the
        sparse distribution sent to the target is exact.
        """
        full = pruned.new_full((*pruned.shape[:-1], self.target_vocab_size), float("-inf"))
        full[..., self.kept_ids.to(pruned.device)] = pruned
        return full


def _draft_state(model: PrunedDraft) -> dict[str, torch.Tensor]:
    """Everything but the shared embedding: that is the target's and is never stored."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(EMBED_KEY)}
    return {k: v.detach().contiguous() for k, v in state.items()}


def save_draft(model: PrunedDraft, folder: str | pathlib.Path, target: str, eos_token_ids: list[int],
               dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> pathlib.Path:
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype) for k, v in _draft_state(model).items()}, str(folder / WEIGHTS))
    (folder / KEPT).write_text(json.dumps(model.kept_ids.tolist()) + "\n")
    meta = {"format": 1, "target": target, "target_vocab_size": model.target_vocab_size,
            "llama_config": model.config.to_dict(), "eos_token_ids": eos_token_ids, **(extra or {})}
    (folder / MARKER).write_text(json.dumps(meta, indent=1, default=str) + "\n")
    return folder


def target_embedding(target: str) -> torch.Tensor:
    """The target's input embedding [V, H], read from its safetensors without loading the model."""
    folder = resolve_model_path(target)
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                if key.endswith(EMBED_KEY):
                    return fh.get_tensor(key)
    raise FileNotFoundError(f"target {target!r} ({folder}): no *{EMBED_KEY} in its safetensors")


def load_draft(folder: str | pathlib.Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               target_override: str | None = None) -> tuple[PrunedDraft, dict]:
    """Builds the draft and fills in the target's embedding. Returns (model in eval mode, metadata)."""
    folder = pathlib.Path(folder)
    if not is_pruned_draft(folder):
        raise FileNotFoundError(f"{folder}: no {MARKER}, so it is not a specdec pruned draft")
    meta = json.loads((folder / MARKER).read_text())
    if meta.get("format") != 1:
        raise ValueError(f"{folder}: unsupported draft format {meta.get('format')!r}")
    kept = json.loads((folder / KEPT).read_text())
    config = LlamaConfig(**meta["llama_config"])
    model = PrunedDraft(config, kept)
    state = load_file(str(folder / WEIGHTS))
    embedding = target_embedding(target_override or meta["target"])
    if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{folder}: the target's embedding is {tuple(embedding.shape)}, the draft expects "
                         f"{(config.vocab_size, config.hidden_size)}: wrong target {meta['target']!r}?")
    state["body." + EMBED_KEY] = embedding
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, meta


class PrunedCausalLM:
    """A pruned draft as a LanguageModel (specdec/model/interface.py): forward a sequence, get [keep, V] logits.

    Logits come back in the TARGET's vocabulary, -inf outside the kept ids, so ModelDrafter's
    argmax and top-k sampling work unchanged and send exact sparse p (p = 0 off the kept vocab).
    """

    fixed_shape = False  # batches and trees: specdec/forward/ builds them over `model`
    has_features = False  # a draft: nobody reads its hidden states
    capturing = False
    max_sequences: int | None = None
    batch_scratch: torch.Tensor | None = None

    def __init__(self, model: PrunedDraft, device: torch.device, eos_token_ids: list[int] | None = None):
        self.model = model
        self.device = device
        self.vocab_size = model.target_vocab_size
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.eos_token_ids = sorted(eos_token_ids or [])
        self.dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")

    def new_cache(self) -> DynamicCache:
        return new_cache(self.model.config)

    def full_attention_cache(self) -> bool:
        return all(full_attention(layer) for layer in self.new_cache().layers)

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.model.to_target_logits(logits)

    def capturing_features(self):
        raise ValueError("a pruned draft hands out no hidden states")

    @torch.inference_mode()
    def forward(self, seq: Sequence, extra: list[int] | tuple[int, ...] = (), keep: int = 1) -> torch.Tensor:
        if seq.cache is None:
            seq.cache = self.new_cache()
        pending = seq.tokens[seq.cached:] + list(extra)
        if not pending:
            raise ValueError("nothing to feed: the store keeps at least one pending token")
        if keep > len(pending):
            raise ValueError(f"cannot keep {keep} logits from {len(pending)} new positions")
        input_ids = torch.tensor([pending], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=input_ids, past_key_values=seq.cache, use_cache=True, logits_to_keep=keep)
        seq.cache = out.past_key_values
        seq.cached += len(pending)
        return self.to_target_logits(out.logits[0, -keep:].float().cpu())  # [keep, V]


def hf_assistant(folder: str | pathlib.Path, target_override: str | None = None):
    """The draft as a transformers model that `generate(assistant_model=...)` accepts.

    Why: `specdec bench` compares specdec with transformers' assisted generation using the SAME
    draft. Transformers has no notion of a pruned head, so this is a LlamaForCausalLM whose forward
    scores the kept rows only and scatters them into -inf logits over the full vocabulary: the same
    arithmetic, and the same cost, as the draft service's PrunedCausalLM.
    """
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    draft, meta = load_draft(folder, "cpu", torch.float32, target_override)

    class PrunedAssistant(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                    use_cache=None, logits_to_keep=0, cache=None, **kwargs):
            kwargs.pop("labels", None)
            cache = cache if cache is not None else past_key_values  # generate() passes `cache` from transformers 5.24
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             **cache_kwargs(self.model, cache), inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
            hidden = out.last_hidden_state
            if isinstance(logits_to_keep, int) and logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            return CausalLMOutputWithPast(logits=draft.to_target_logits(draft.head(hidden)),
                                          **{output_field(CausalLMOutputWithPast): returned_cache(out)})

    config = LlamaConfig(**{**draft.config.to_dict(), "tie_word_embeddings": False})
    with torch.device("meta"):  # the full-vocabulary lm_head is never used: do not allocate it
        assistant = PrunedAssistant(config)
    assistant.model = draft.body
    assistant.lm_head = torch.nn.Identity()
    assistant.eval()
    eos = meta.get("eos_token_ids") or None
    assistant.generation_config = GenerationConfig(eos_token_id=eos)
    return assistant
