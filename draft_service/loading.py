"""Loading the drafter a DraftConfig names, and the engine over it (blocking: loads weights).

Which drafter a config means: `--drafter ngram` is prompt lookup; `--drafter model` with a
feature draft's folder, a pruned draft's folder, or any other model spec (with --target-tokenizer,
one that maps to the target's vocabulary). What the service says it hosts (`DrafterInfo`) is read
off the drafter built.
"""

from __future__ import annotations

import dataclasses

from draft_service.config import DraftConfig
from specdec.model.interface import sequence_bound
from draft_service.drafters.base import Drafter
from draft_service.drafters.model import ModelDrafter, load_pruned_drafter
from draft_service.drafters.ngram import NgramDrafter
from draft_service.engine import DraftEngine
from specdec.model.cpu import gemm


@dataclasses.dataclass(frozen=True)
class DrafterInfo:
    """What the service says it hosts (GetInfo's ModelInfo, field for field)."""

    model: str
    drafter: str  # "model", "ngram" or "feature"
    vocab_size: int = 0  # 0: no vocabulary to check against the target's (n-gram, another vocabulary)
    max_context: int = 0
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    device: str = ""
    dtype: str = ""
    needs_features: bool = False
    weights: str = ""  # what the forward reads the weights as (--weights); empty without weights (n-gram)
    weight_bytes: int = 0


def _lm_info(config: DraftConfig, drafter: Drafter, kind: str, **overrides) -> DrafterInfo:
    """A model draft's info, read off its `lm` (a ModelDescription: specdec/model/interface.py)."""
    lm = drafter.lm
    fields = {"max_context": lm.max_context, "eos_token_ids": list(lm.eos_token_ids), "device": str(lm.device),
              "dtype": lm.dtype_name} | overrides
    return DrafterInfo(config.model, kind, drafter.vocab_size, **fields)


def _load_model_drafter(config: DraftConfig) -> tuple[Drafter, DrafterInfo]:
    """A plain causal LM draft, loaded and packed as the target is (load_lm); with --target-tokenizer,
    one that maps to the target's vocabulary (unless the two tokenizers turn out the same)."""
    if not config.model:
        raise ValueError("--drafter model needs --model (alias, hub id, folder or .gguf)")
    from specdec.model.assembly import LMOptions, load_lm

    # Its decode steps are 1-row GEMMs: every row count takes the kernel. On a GPU the draft runs the
    # same fixed-shape passes as the target for their speed (one CUDA graph a step).
    served = load_lm(LMOptions(model=config.model, device=config.device, dtype=config.dtype, weights=config.weights,
                               packed_gemm_rows=config.packed_gemm_rows, packed_gemm_min_rows=gemm.DEFAULT_MIN_ROWS,
                               numerics=config.numerics, pass_rows=config.pass_rows, static_slots=config.static_slots,
                               static_context=config.static_context))
    lm, loaded = served.lm, served.loaded
    # loaded.path: where --weights gguf found the file's blocks
    drafter: Drafter = ModelDrafter(lm, config.top_k, staged=config.staged, source=loaded.path)
    if config.target_tokenizer:
        from draft_service.drafters.other_vocab import build_cross_drafter

        drafter = build_cross_drafter(lm, loaded.tokenizer, config.model, config.target_tokenizer, config.top_k,
                                      source=loaded.path) or drafter
    return drafter, _lm_info(config, drafter, "model", device=str(loaded.device), dtype=str(loaded.dtype).removeprefix("torch."),
                             weights=served.weights, weight_bytes=served.weight_bytes)


def _packed(config: DraftConfig, drafter: Drafter, info: DrafterInfo) -> DrafterInfo:
    """Packs a pruned or feature draft's linear layers (its decode steps are 1-row GEMMs); its info
    with the weights it serves."""
    model = drafter.lm.model
    parameter = next(model.parameters())
    weights = config.weights
    if (info.needs_features and weights == gemm.AUTO and config.packed_gemm_rows > 0
            and gemm.available(parameter.device, parameter.dtype)):
        from specdec.model.feature_draft import compact_weights

        weights = compact_weights()  # a feature draft has no GGUF of its own: its auto is the format measured fastest
    packed = gemm.apply(model, parameter.device, parameter.dtype, config.packed_gemm_rows, gemm.DEFAULT_MIN_ROWS,
                        weights, drafter.source)
    return dataclasses.replace(info, weights=packed.weights if packed else str(parameter.dtype).removeprefix("torch."),
                               weight_bytes=packed.weight_bytes if packed else gemm.linear_bytes(model))


def load_drafter(config: DraftConfig) -> tuple[Drafter, DrafterInfo]:
    """The drafter the config names, its weights packed, and its info (blocking: loads weights)."""
    from specdec.model.loading import feature_draft_folder, pruned_draft_folder

    if config.drafter == "ngram":
        return NgramDrafter(config.ngram_max, config.ngram_min), DrafterInfo("ngram", "ngram")
    on_disk = config.drafter == "model" and config.model  # a pruned or feature draft's folder, or a model spec
    pruned = pruned_draft_folder(config.model) if on_disk else None
    featured = feature_draft_folder(config.model) if on_disk else None
    if featured is not None:  # drafts from the target's hidden states (specdec/model/feature_draft.py)
        from draft_service.drafters.feature import load_feature_drafter

        drafter = load_feature_drafter(featured, config.device, config.dtype, config.top_k)
        return drafter, _packed(config, drafter, _lm_info(config, drafter, "feature", needs_features=True))
    if pruned is not None:  # a distilled draft in its target's own vocabulary (specdec/model/pruned.py)
        drafter = load_pruned_drafter(pruned, config.device, config.dtype, config.top_k, staged=config.staged)
        return drafter, _packed(config, drafter, _lm_info(config, drafter, "model"))
    return _load_model_drafter(config)


def load_engine(config: DraftConfig) -> tuple[DraftEngine, DrafterInfo]:
    """The engine over the drafter the config names, warmed up, and its info (blocking: call it
    off the event loop)."""
    drafter, info = load_drafter(config)
    # a fixed-shape draft (specdec/model/gpu/static.py) holds at most its slots' sequences
    engine = DraftEngine(drafter, sequence_bound(config.max_sequences, drafter.lm), config.idle_timeout_s,
                         config.max_prefill_tokens_per_pass)
    engine.warm_up()
    return engine, info
