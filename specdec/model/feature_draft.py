"""A feature draft (EAGLE-style): one transformer layer that drafts from the TARGET's own hidden states.

Why: no model small enough to draft for SmolLM2-135M agrees with it often (its own first layers under
5%, a distilled 2-layer copy about 24% per token), because a small model has to rebuild from tokens
alone everything the target's 30 layers know. The target's final hidden state already holds that.
So the draft takes, at each position i, the target's feature f_i (its post-norm last hidden state,
from which the target's own head reads token i+1) together with the embedding of the token that
followed, x_{i+1}, and predicts the next feature f_{i+1}; the target's head rows over a pruned
vocabulary turn that into a token. Drafting k tokens feeds its own predicted features back in.
Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (2024).

What this asks of the system: the target returns the features of the positions it has made
canonical (Verify's `return_features`), the coordinator forwards them with the next Propose, and the
draft keeps a KV cache over (feature, next token) pairs, of which the pair count is always one less
than the token count: the last canonical token's feature is computed by the target's next pass.

Folder format (written by `save_feature_draft`, read by `load_feature_draft`):
    specdec_feature_draft.json  {"format": 1, "target": <spec>, "target_vocab_size": V,
                                 "llama_config": {...}, "eos_token_ids": [...], "report": {...},
                                 "feature_layers": [...] (fused drafts only; absent: the final hidden states)}
    kept_vocab.json             the N kept target token ids, in head-row order
    model.safetensors           fc, the layer, norm and head [N, hidden], fuse if fused (the embedding is the target's)
    README.md                   the model card
"""

from __future__ import annotations

import copy
import json
import pathlib

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, LlamaConfig, LlamaModel

from specdec.model.cpu import stack
from specdec.model.draft_folders import FEATURE_MARKER, is_feature_draft
from specdec.model.hfcache import cache_kwargs

MARKER = FEATURE_MARKER
KEPT = "kept_vocab.json"
WEIGHTS = "model.safetensors"


class FeatureDraft(torch.nn.Module):
    """fc([embed(x_{i+1}); f_i]) -> Llama layer(s) -> norm = predicted f_{i+1}; head over kept ids."""

    def __init__(self, config: LlamaConfig, kept_ids: list[int], target_vocab_size: int,
                 feature_layers: tuple[int, ...] | list[int] = ()):
        super().__init__()
        if len(set(kept_ids)) != len(kept_ids) or not kept_ids:
            raise ValueError("kept_ids must be a non-empty list of distinct target token ids")
        if min(kept_ids) < 0 or max(kept_ids) >= target_vocab_size:
            raise ValueError(f"kept_ids must lie in the target vocabulary [0, {target_vocab_size})")
        hidden = config.hidden_size
        # The body never sees token ids (inputs_embeds only): a 1-row embedding keeps it from allocating V x H.
        self.config = LlamaConfig(**{**config.to_dict(), "vocab_size": 1, "architectures": None,
                                     "pad_token_id": None, "eos_token_id": None, "bos_token_id": None})
        self.target_vocab_size = int(target_vocab_size)
        self.embed = torch.nn.Embedding(target_vocab_size, hidden)  # the target's, frozen, never stored
        self.embed.requires_grad_(False)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        self.body = LlamaModel(self.config)
        self.head = torch.nn.Linear(hidden, len(kept_ids), bias=False)
        self.register_buffer("kept_ids", torch.tensor(kept_ids, dtype=torch.long), persistent=False)
        # EAGLE-3's fused features: the target sends the outputs of several of its layers, concatenated,
        # and `fuse` maps them to one hidden-sized feature. The draft's own predictions stay hidden-sized.
        # Empty: the target's final hidden states, taken as they are (every draft before fused ones).
        self.feature_layers = tuple(int(layer) for layer in feature_layers)
        self.fuse = torch.nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False) if self.feature_layers else None

    def get_decoder(self) -> LlamaModel:
        """Its layers and norm, as transformers' models name their decoder: the compact one-call
        stack (specdec/model/cpu/stack.py) installs itself there."""
        return self.body

    @property
    def feature_dim(self) -> int:
        """The width of the target features this draft reads (FeatureRows.values' columns)."""
        return self.config.hidden_size * max(1, len(self.feature_layers))

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_dim] -> the hidden-sized features forward() takes."""
        return features if self.fuse is None else self.fuse(features)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, past_key_values: DynamicCache | None = None,
                use_cache: bool = False, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, T, H] (f_i), next_tokens [B, T] (x_{i+1}) -> (predicted f_{i+1} [B, T, H], logits [B, T, N]).
        logits_to_keep > 0: the logits of the last so many positions only (as transformers' own), since
        a prefill of a prompt's pairs reads one row's, and the head is half the draft's weights.

        attention_mask [B, 1, T, cached + T] (0 or the dtype's min) and position_ids [B, T]: a tree
        level's pairs, each seeing the cached pairs and its own ancestors (draft_service/drafters/
        feature.py); None: causal after the cache, as a chain."""
        x = self.inputs(features, next_tokens)
        if use_cache and attention_mask is None and position_ids is None and past_key_values is not None:
            out = stack.forward_embeds(self.body, x, past_key_values)  # compact weights: one C call, the same bits
            if out is not None:
                predicted = self.body.norm(out)
                return predicted, self._head(predicted, logits_to_keep)
        out = self.body(inputs_embeds=x, **cache_kwargs(self.body, past_key_values), use_cache=use_cache,
                        attention_mask=attention_mask, position_ids=position_ids)
        predicted = out.last_hidden_state
        return predicted, self._head(predicted, logits_to_keep)

    def _head(self, predicted: torch.Tensor, keep: int) -> torch.Tensor:
        return self.head(predicted[:, -keep:] if keep else predicted)

    def inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The body's input embeddings of pairs (f_i, x_{i+1}): [B, T, H]. Training calls the body
        with its own attention mask over these (specdec_tools/distill_feature.py)."""
        return self.fc(torch.cat([self.embed(next_tokens).to(features.dtype), features], dim=-1))

    def to_target_logits(self, pruned: torch.Tensor) -> torch.Tensor:
        """[..., N] -> [..., V] with -inf outside the kept ids, so the draft's p there is exactly 0."""
        full = pruned.new_full((*pruned.shape[:-1], self.target_vocab_size), float("-inf"))
        full[..., self.kept_ids.to(pruned.device)] = pruned
        return full


def init_from_target(target, kept: list[int], layers: int = 1, feature_layers: tuple[int, ...] = (),
                     feature_rms: float = 1.0) -> FeatureDraft:
    """Layers, norm and head rows start as the target's last `layers` layers, final norm and output rows.

    The last layers are the ones whose input most resembles a feature, so they are the nearest start; fc
    starts as "take the feature, add a little of the token" so step 0 already predicts something.
    With feature_layers, fuse starts as the last named layer's output divided by its RMS over the
    data (feature_rms): a normalised residual stream near the final features the rest expects.
    """
    tcfg = target.config
    if not 1 <= layers <= tcfg.num_hidden_layers:
        raise ValueError(f"a feature draft has 1 to {tcfg.num_hidden_layers} layers (the target's count), not {layers}")
    cfg = LlamaConfig(**{**tcfg.to_dict(), "num_hidden_layers": layers, "tie_word_embeddings": False, "torch_dtype": "float32"})
    draft = FeatureDraft(cfg, kept, int(tcfg.vocab_size), feature_layers)
    body = target.model
    with torch.no_grad():
        for i, layer in enumerate(body.layers[len(body.layers) - layers:]):
            draft.body.layers[i].load_state_dict(layer.state_dict())
        draft.body.norm.weight.copy_(body.norm.weight)
        draft.embed.weight.copy_(body.embed_tokens.weight)
        draft.head.weight.copy_(target.get_output_embeddings().weight[torch.tensor(kept)])
        hidden = cfg.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, hidden:] = torch.eye(hidden)
        draft.fc.weight[:, :hidden] = 0.1 * torch.eye(hidden)
        draft.fc.bias.zero_()
        if draft.fuse is not None:
            draft.fuse.weight.zero_()
            draft.fuse.weight[:, -hidden:] = torch.eye(hidden) / feature_rms
    return draft


def _state(model: FeatureDraft) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()
            if not k.startswith("embed.") and k != "body.embed_tokens.weight"}


def save_feature_draft(model: FeatureDraft, folder: str | pathlib.Path, target: str, eos_token_ids: list[int],
                       dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> pathlib.Path:
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype) for k, v in _state(model).items()}, str(folder / WEIGHTS))
    (folder / KEPT).write_text(json.dumps(model.kept_ids.tolist()) + "\n")
    meta = {"format": 1, "target": target, "target_vocab_size": model.target_vocab_size,
            "llama_config": model.config.to_dict(), "eos_token_ids": eos_token_ids, **(extra or {})}
    if model.feature_layers:
        meta["feature_layers"] = list(model.feature_layers)  # absent: the target's final hidden states
    (folder / MARKER).write_text(json.dumps(meta, indent=1, default=str) + "\n")
    return folder


def load_feature_draft(folder: str | pathlib.Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       target_override: str | None = None) -> tuple[FeatureDraft, dict]:
    """Builds the draft and fills in the target's input embedding (read from the target's safetensors)."""
    from specdec.model.pruned import target_embedding

    folder = pathlib.Path(folder)
    if not is_feature_draft(folder):
        raise FileNotFoundError(f"{folder}: no {MARKER}, so it is not a specdec feature draft")
    meta = json.loads((folder / MARKER).read_text())
    if meta.get("format") != 1:
        raise ValueError(f"{folder}: unsupported feature-draft format {meta.get('format')!r}")
    kept = json.loads((folder / KEPT).read_text())
    config = LlamaConfig(**meta["llama_config"])
    model = FeatureDraft(config, kept, int(meta["target_vocab_size"]), meta.get("feature_layers") or ())
    state = load_file(str(folder / WEIGHTS))
    embedding = target_embedding(target_override or meta["target"])
    if tuple(embedding.shape) != (model.target_vocab_size, config.hidden_size):
        raise ValueError(f"{folder}: the target's embedding is {tuple(embedding.shape)}, the draft expects "
                         f"{(model.target_vocab_size, config.hidden_size)}: wrong target {meta['target']!r}?")
    state["embed.weight"] = embedding
    missing = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False).missing_keys
    if set(missing) - {"body.embed_tokens.weight"}:
        raise ValueError(f"{folder}: weights missing {sorted(missing)}")
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, meta


def compact_weights() -> str:
    """What `--weights auto` serves a feature draft as on a CPU (draft_service/loading.py). The draft's
    numerics only choose its proposals, never the output (the target verifies every token), so the
    format is picked for speed at the proposals' agreement: int8 weights, against activations rounded
    to int8 (the target's `-a8` arithmetic) where the CPU has 8-bit dot-product instructions, else
    expanded to floats in registers (without VNNI the integer products take several instructions
    each and the float path is faster). Both agree with the fp32 draft's top-1 on nearly every
    position (the model card has the figures; tests/test_compact_feature_draft.py bounds it)."""
    from specdec.model.cpu import gemm

    return "int8-a8" if gemm.int8_dot_products() else "int8"


def cut_head(model: FeatureDraft, keep: list[int]) -> FeatureDraft:
    """A copy of the draft whose head keeps only the target ids `keep` (a subset of its kept ids).

    Why: the head is about half the draft's weights, and each row is read every drafted token; the
    rows of rare tokens buy little agreement. Tokens cut get draft probability 0 (to_target_logits),
    which rejection sampling handles as it does every token outside the head. The body, fc and norm
    are shared with `model`, not copied."""
    rows = {int(t): i for i, t in enumerate(model.kept_ids.tolist())}
    if not keep or len(set(keep)) != len(keep) or any(int(t) not in rows for t in keep):
        raise ValueError("keep must be distinct ids, all of them kept by the draft's head")
    keep = sorted(int(t) for t in keep)
    # A shallow copy with its own module and buffer tables: every other part (and any attribute a
    # later version adds) stays the original's.
    cut = copy.copy(model)
    cut._modules, cut._buffers, cut._parameters = dict(model._modules), dict(model._buffers), dict(model._parameters)
    weight = model.head.weight.detach()[torch.tensor([rows[t] for t in keep], device=model.head.weight.device)]
    cut.head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    cut.head.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    cut.register_buffer("kept_ids", torch.tensor(keep, dtype=torch.long, device=model.kept_ids.device), persistent=False)
    return cut
