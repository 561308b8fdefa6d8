"""What a language model is to the engines: the `LanguageModel` protocol (issue 58 item 1).

Three implementations, one per way of computing a Llama-family forward, chosen once at load
(specdec/model/assembly.py `load_lm`):

- `CausalLM` (lm.py): transformers' forward, the reference the others are tested against. Loaded
  with compact weights it computes with specdec's kernel, the lean layer (decoder.py) and, for
  chains, the one-call C stack (stack.py), which tests/test_decoder_stack.py holds bit for bit to
  the lean layer.
- `StaticLM` (static.py): passes of one shape over a static cache, row-exact on a GPU.
- `PrunedCausalLM` (pruned.py): a distilled draft whose head covers part of the target's vocabulary.

A feature draft (feature_draft.py) computes from the target's hidden states, not from tokens alone:
its drafter runs its own forwards and describes its weights with a `ModelDescription` only.

Every member is declared by every implementation, so no caller tells the kinds apart by probing
for attributes (tests/test_structure.py finds none). specdec/forward/ builds the padded batches and
the tree passes over `model` for the implementations that run transformers' forward, and hands
them to the LM's own methods where `fixed_shape` says it has them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.kv.store import Sequence


@runtime_checkable
class ModelDescription(Protocol):
    """What the services read off a loaded model: its GetInfo fields, its bound on sequences, and
    the module that holds its weights."""

    model: torch.nn.Module  # the weights' module: the loader packs its linear layers (gemm.apply)
    device: torch.device
    vocab_size: int  # logits come back over this many ids (a pruned draft: the target's vocabulary)
    max_context: int  # positions a sequence may hold; 0: the model does not say
    eos_token_ids: list[int]
    dtype_name: str  # the weights' dtype as GetInfo reports it ("float32", "bfloat16")
    max_sequences: int | None  # sequences its cache holds at once (a static cache's slots); None: no bound of its own


@runtime_checkable
class LanguageModel(ModelDescription, Protocol):
    """A causal LM the engines run: feed a sequence's pending tokens, get float32 CPU logits.

    A Sequence (specdec/kv/store.py) holds the tokens, how many of them the cache holds, and the
    cache the LM made (`new_cache`); every forward feeds seq.tokens[seq.cached:] and advances
    seq.cached. Not thread-safe: the engines run one forward at a time per model.
    """

    # True: batches and trees run as this LM's own `forward_batch` / `forward_tree`, passes of one
    # shape that hold any rows (static.py); False: specdec/forward/ builds them over `model`.
    fixed_shape: bool
    has_features: bool  # capturing_features can hand out the final hidden states
    # Memory the padded batch reuses from one step to the next (specdec/forward/batching.py _scratch);
    # None until the first batch. Per model, since each model runs on its own worker thread.
    batch_scratch: torch.Tensor | None

    def new_cache(self) -> Any:
        """An empty cache for one sequence (a DynamicCache, or a slot of a static cache)."""
        ...

    def forward(self, seq: Sequence, extra: list[int] | tuple[int, ...] = (), keep: int = 1) -> torch.Tensor:
        """Feeds seq.tokens[seq.cached:] + extra in one pass; the logits of the last `keep`
        positions, [keep, V] float32 on the CPU. The extra tokens enter the cache too."""
        ...

    def full_attention_cache(self) -> bool:
        """Whether every layer's cache holds every position (no sliding window): only then do rows
        of a padded batch line up position by position, and a tree's path can be gathered by index."""
        ...

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., N] logits as `model` scores them -> [..., vocab_size]: the identity for a model with
        a full head, a scatter into -inf for a pruned draft's."""
        ...

    def capturing_features(self) -> AbstractContextManager[list[torch.Tensor]]:
        """Within the block, each forward appends its final hidden states [B, T, H] to the list."""
        ...

    @property
    def capturing(self) -> bool:
        """Whether a capturing_features block is open: a path that cannot hand features out steps aside."""
        ...


# The members every implementation declares, for the structure test and for readers.
DESCRIPTION_MEMBERS = ("model", "device", "vocab_size", "max_context", "eos_token_ids", "dtype_name", "max_sequences")
LM_MEMBERS = (*DESCRIPTION_MEMBERS, "fixed_shape", "has_features", "batch_scratch", "new_cache", "forward",
              "full_attention_cache", "to_target_logits", "capturing_features", "capturing")


def sequence_bound(requested: int, lm: ModelDescription | None) -> int:
    """The sequences an engine over `lm` holds at once: `requested` (its --max-sequences), within the
    model's own bound (a static cache's slots) where it has one."""
    bound = lm.max_sequences if lm is not None else None
    return requested if bound is None else min(requested, bound)
