"""Drafting from the target's hidden states (specdec/model/feature_draft.py) inside the draft service.

Per sequence the draft holds the canonical tokens x_0..x_{L-1} (the store's Sequence), the target
features f_0..f_{n-1} it was sent (seq.side, a FeatureState; normally n = L - 1, since the target
has not yet run the last token) and a KV cache over "pairs" (f_i, x_{i+1}) computed from TRUE
features only (seq.cached counts pairs). A step:
  1. feeds the true pairs it has not cached, the last one re-fed each step: its output is the
     prediction of f_n that everything after starts from;
  2. if features lag the tokens (a run-ahead, which builds on a draft the target has not verified),
     walks the missing positions with its own predicted features;
  3. drafts: each token comes from the predicted feature's head logits, and (predicted feature,
     token) is the next pair;
  4. crops the cache back to the true pairs, since predicted features must not outlive the step.
A tree (`propose_tree`) starts as 1-2 do and is chosen as a model draft's tree is (draft_service/
tree.py): each level is one forward over the nodes to expand, a node's pair being (its parent's
predicted feature, its token) at the position by its depth, seeing the cached pairs and its own
ancestors only: along any root-to-node path exactly the pairs step 3 would feed as a chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from draft_service.drafters.base import Proposal
from draft_service.drafters.model import ModelDrafter
from draft_service.tree import TreeBuilder, TreeDraft
from specdec.model.feature_draft import FeatureDraft
from specdec.errors import InvalidArgument
from specdec.model.features import FeatureRows
from specdec.kv.buffers import new_cache
from specdec.kv.store import Sequence, crop_to
from specdec.calls.request import ProposeCall


@dataclasses.dataclass
class FeatureState:
    """The target features a draft sequence holds: rows [0, count) of `values`."""

    values: torch.Tensor  # [capacity, H] in the draft's dtype
    count: int = 0


class _LmInfo:
    """What the service's GetInfo and the engine read off a drafter's `lm`: a ModelDescription
    (specdec/model/interface.py). The drafter runs the forwards itself, from the target's features."""

    max_sequences: int | None = None  # a DynamicCache per sequence: the engine's own bound applies

    def __init__(self, model: FeatureDraft, device: torch.device, eos_token_ids: list[int]):
        self.model = model
        self.device = device
        self.vocab_size = model.target_vocab_size
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.eos_token_ids = sorted(eos_token_ids)
        self.dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")


class FeatureDrafter(ModelDrafter):
    """Token choice (greedy, top-k sampling, the cumulative-probability stop) is ModelDrafter's, the
    tree's choice TreeBuilder's; the forwards and the features are its own."""

    kind = "feature"
    needs_features = True

    def __init__(self, model: FeatureDraft, device: torch.device, eos_token_ids: list[int] | None = None, top_k: int = 32):
        super().__init__(_LmInfo(model, device, eos_token_ids or []), top_k)
        self.model = model
        self.feature_dim = int(model.config.hidden_size)
        self.dtype = next(model.parameters()).dtype

    def receive(self, seq: Sequence, rows: FeatureRows | None) -> None:
        """Keeps the held features before rows.start and puts the sent rows after them (after the
        store's sync, so seq.tokens is the canonical sequence)."""
        state = seq.side if isinstance(seq.side, FeatureState) else None
        if state is None or len(seq.tokens) == 0:
            state = seq.side = FeatureState(torch.empty(0, self.feature_dim, dtype=self.dtype))
        state.count = min(state.count, max(0, len(seq.tokens) - 1))  # a rollback drops the features past it
        if rows is None:
            return
        if rows.start > state.count:
            raise InvalidArgument("features.start",
                                  f"is {rows.start}, but the draft holds features for {state.count} positions of this sequence")
        if rows.rows and rows.values.shape[1] != self.feature_dim:
            raise InvalidArgument("features.dim", f"is {rows.values.shape[1]}, the draft's hidden size is {self.feature_dim}")
        if rows.end > len(seq.tokens):
            raise InvalidArgument("features", f"covers positions up to {rows.end}, past the sequence's {len(seq.tokens)} tokens")
        if state.values.shape[0] < rows.end:
            grown = torch.empty(max(rows.end, 2 * state.values.shape[0], 64), self.feature_dim, dtype=self.dtype)
            grown[:rows.start] = state.values[:rows.start]
            state.values = grown
        state.values[rows.start:rows.end] = rows.values.to(self.dtype)
        state.count = rows.end

    def propose(self, seq: Sequence, call: ProposeCall, start: float) -> Iterator[Proposal]:
        state = seq.side if isinstance(seq.side, FeatureState) else None
        if state is None or state.count == 0 or len(seq.tokens) < 2:
            return  # nothing to draft from yet: the first Verify brings the prompt's features
        yield from self._draft(seq, state, call, start)

    def propose_tree(self, seq: Sequence, call: ProposeCall, start: float) -> TreeDraft:
        state = seq.side if isinstance(seq.side, FeatureState) else None
        if state is None or state.count == 0 or len(seq.tokens) < 2:
            return TreeDraft([], [], [])  # nothing to draft from yet, as for a chain
        return FeatureTreeBuilder(self, seq, state, call).build()

    def batches(self, call: ProposeCall) -> bool:
        return False  # its forwards are the feature draft's own, not the batcher's

    @torch.inference_mode()
    def _start(self, seq: Sequence, state: FeatureState) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Steps 1 and 2: feeds the true pairs (the last re-fed) and walks the positions whose
        features lag. Returns (the predicted feature after the last token [1, 1, H], its head's
        logits [1, 1, N], the true pair count: what the cache is cropped back to afterwards). The
        cache then holds len(seq.tokens) - 1 pairs; seq.cached counts the true ones."""
        device = self.lm.device
        tokens = seq.tokens
        true_pairs = min(state.count, len(tokens) - 1)
        # Re-feed the last true pair: its output starts the chain. Cropped by absolute length, since
        # a step abandoned mid-way (a cancelled call) may have left predicted pairs behind.
        keep = min(seq.cached, true_pairs - 1)
        if seq.cache is not None and keep > 0:
            crop_to(seq.cache, keep)
        else:
            seq.cache = new_cache(self.model.config)  # appending in place, as the compact stack's one call needs
            keep = 0
        seq.cached = keep
        feats = state.values[seq.cached:true_pairs][None].to(device)
        nxt = torch.tensor([tokens[seq.cached + 1:true_pairs + 1]], dtype=torch.long, device=device)
        predicted, logits = self.model(feats, nxt, seq.cache, use_cache=True, logits_to_keep=1)
        seq.cached = true_pairs
        feature = predicted[:, -1:]
        try:
            for i in range(true_pairs, len(tokens) - 1):  # features lag the tokens: walk them with predictions
                feature, logits = self.model(feature, torch.tensor([[tokens[i + 1]]], device=device), seq.cache, use_cache=True)
        except BaseException:
            crop_to(seq.cache, true_pairs)
            raise
        return feature, logits[:, -1:], true_pairs

    @torch.inference_mode()
    def _draft(self, seq: Sequence, state: FeatureState, call: ProposeCall, start: float) -> Iterator[Proposal]:
        device = self.lm.device
        tokens = seq.tokens
        feature, logits, true_pairs = self._start(seq, state)
        try:
            chain = self.begin(call, start)
            while True:
                self.forwards += 1
                # chosen among the head's rows, not the whole vocabulary: the same choice, the same
                # distribution (every other token's p is 0), without scattering and normalising V logits
                proposal = self.choose(logits[0, -1].float().cpu(), chain, self.model.kept_ids.cpu())
                if proposal is None:
                    return
                tokens.append(proposal.token)
                yield proposal
                if chain.done:
                    return
                feature, logits = self.model(feature[:, -1:], torch.tensor([[proposal.token]], device=device), seq.cache, use_cache=True)
        finally:
            crop_to(seq.cache, true_pairs)  # predicted pairs never outlive the step


class FeatureTreeBuilder(TreeBuilder):
    """A dynamic or static tree (draft_service/tree.py) over the feature draft's pairs: the
    choosing is TreeBuilder's, the forwards are the feature draft's. Each node's pair is (its
    parent's predicted feature, its token); its own predicted feature feeds its children."""

    def __init__(self, drafter: FeatureDrafter, seq: Sequence, state: FeatureState, call: ProposeCall):
        super().__init__(drafter.lm, seq, call, drafter.top_k)
        self.drafter, self.state = drafter, state
        self.model = drafter.model
        self.features: dict[int, torch.Tensor] = {}  # node (-1: the root) -> its predicted feature [1, 1, H]
        self.true_pairs: int | None = None

    def _root(self) -> torch.Tensor:
        feature, logits, self.true_pairs = self.drafter._start(self.seq, self.state)
        self.seq.cached = len(self.seq.tokens) - 1  # the walked pairs too: every node sees them
        self.features[-1] = feature
        self.drafter.forwards += 1
        return self.model.to_target_logits(logits[0, -1].float().cpu())

    @torch.inference_mode()
    def _forward_level(self, ids: list[int], positions: list[int], attend: torch.Tensor) -> torch.Tensor:
        device = self.lm.device
        feats = torch.cat([self.features[self.nodes[i].parent] for i in ids], dim=1)  # [1, n, H]
        tokens = torch.tensor([[self.nodes[i].token for i in ids]], dtype=torch.long, device=device)
        dtype = self.drafter.dtype
        mask = torch.zeros(attend.shape, dtype=dtype).masked_fill(~attend, torch.finfo(dtype).min)
        predicted, logits = self.model(feats, tokens, self.seq.cache, use_cache=True, attention_mask=mask[None, None].to(device),
                                       position_ids=torch.tensor([positions], dtype=torch.long, device=device))
        self.seq.cached += len(ids)
        self.drafter.forwards += 1
        for row, i in enumerate(ids):
            self.features[i] = predicted[:, row:row + 1]
        return self.model.to_target_logits(logits[0].float().cpu())

    def _close(self) -> None:
        if self.true_pairs is not None:  # predicted pairs never outlive the call
            crop_to(self.seq.cache, self.true_pairs)
            self.seq.cached = self.true_pairs


def load_feature_drafter(folder, device: str = "auto", dtype: str = "auto", top_k: int = 32) -> FeatureDrafter:
    from specdec.model.feature_draft import load_feature_draft
    from specdec.model.loading import resolve_device, resolve_dtype

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model, meta = load_feature_draft(folder, dev, dt)
    if model.feature_layers:
        raise ValueError(f"{folder}: a draft over fused target layers {list(model.feature_layers)}; the services send only "
                         "the target's final hidden states so far (specdec distill --evaluate measures it)")
    return FeatureDrafter(model, dev, meta.get("eos_token_ids"), top_k)
