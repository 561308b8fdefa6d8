"""A causal LM behind the one call both services need: feed a sequence's pending tokens, get logits.

Kept free of gRPC and of any policy, so the draft and the target share it and tests drive it
directly (tests/test_kv_store.py checks rollback against a fresh forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.model.cpu import stack
from specdec.model.hfcache import cache_kwargs, returned_cache
from specdec.kv.buffers import full_attention, new_cache
from specdec.kv.store import Sequence


class CausalLM:
    """A transformers model as a LanguageModel (specdec/model/interface.py): transformers' forward,
    the reference the other forwards are held to. Every tensor that leaves it is float32 on the CPU.

    The model is inspected here, once: what the engines need to know about it becomes a declared
    field, so nothing downstream probes the module for its kind."""

    fixed_shape = False  # batches and trees: specdec/forward/ builds them over `model`
    max_sequences: int | None = None  # a DynamicCache per sequence: the engine's own bound applies
    batch_scratch: torch.Tensor | None = None

    def __init__(self, model: PreTrainedModel, device: torch.device):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"CausalLM serves a transformers model (PreTrainedModel), not {type(model).__name__}")
        self.model = model
        self.device = device
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 0)
        generation = model.generation_config  # None for a model that cannot generate
        eos = generation.eos_token_id if generation is not None else None
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        self.eos_token_ids = sorted({eos} if isinstance(eos, int) else set(eos or ()))
        self.dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
        # Feature drafts (specdec/model/feature_draft.py) read the final norm's output, the vectors the output layer
        # reads; a forward hook there sees every position, before logits_to_keep drops any.
        norm = getattr(model.get_decoder(), "norm", None)
        self.has_features = isinstance(norm, torch.nn.Module)
        self._captured: list[torch.Tensor] | None = None
        if self.has_features:
            norm.register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        if self._captured is not None:
            self._captured.append(output.detach())

    @contextlib.contextmanager
    def capturing_features(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, each forward appends its final hidden states [B, T, H] to the list.

        Not re-entrant and not for concurrent forwards: the engines run one forward at a time.
        """
        if not self.has_features:
            raise ValueError("this model has no final norm (get_decoder().norm) to read hidden states from")
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None

    @property
    def capturing(self) -> bool:
        return self._captured is not None

    def new_cache(self) -> DynamicCache:
        return new_cache(self.model.config)  # appends in place: no O(context) copy per step

    def full_attention_cache(self) -> bool:
        return all(full_attention(layer) for layer in self.new_cache().layers)

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits  # the model's head covers the whole vocabulary

    @torch.inference_mode()
    def forward(self, seq: Sequence, extra: list[int] | tuple[int, ...] = (), keep: int = 1) -> torch.Tensor:
        """Feeds seq.tokens[seq.cached:] + extra in ONE pass; returns logits of the last `keep` positions.

        The extra tokens (a proposal being scored) enter the cache too; the caller crops them away
        with `seq.crop_cache` once it knows how many were accepted. Returns [keep, V] float32.
        """
        if seq.cache is None:
            seq.cache = self.new_cache()
        pending = seq.tokens[seq.cached:] + list(extra)
        if not pending:
            raise ValueError("nothing to feed: the store keeps at least one pending token")
        if keep > len(pending):
            raise ValueError(f"cannot keep {keep} logits from {len(pending)} new positions")
        if stack.applies(self):
            # Straight through the one-call decoder stack, as a batch of one row: transformers'
            # model-level wrappers (output capture, config defaults, keyword checks) cost a tenth
            # of a decode step around a stack that is one C call. The same kernels, the same bits.
            logits = stack.forward_rows(self, [seq], [pending], [keep])
            if logits is not None:
                return logits[0].cpu()
        input_ids = torch.tensor([pending], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=input_ids, **cache_kwargs(self.model, seq.cache), use_cache=True, logits_to_keep=keep)
        seq.cache = returned_cache(out)
        seq.cached += len(pending)
        return out.logits[0, -keep:].float().cpu()  # [keep, V]



def feed(lm, seq: Sequence, count: int) -> None:
    """Feeds the next `count` of seq's pending tokens into lm's cache and nothing after them (one
    chunk of a long prompt, specdec/serving/batcher.py Requeue); their logits are not needed. `lm`:
    anything with CausalLM's forward (a pruned draft's too)."""
    with pending_only(seq, count):
        lm.forward(seq, [], keep=1)


@contextlib.contextmanager
def pending_only(seq: Sequence, count: int):
    """seq as if only its next `count` pending tokens were known, while a forward (which feeds
    seq.tokens[seq.cached:]) feeds them as one chunk."""
    tokens = seq.tokens
    seq.tokens = tokens[:seq.cached + count]
    try:
        yield seq
    finally:
        seq.tokens = tokens
