"""What every drafter is to the draft engine: the `Drafter` protocol, and the proposals it makes.

A drafter turns a synced sequence (the store's Sequence: canonical tokens, rolled back and caught
up by the engine) into proposals, one token at a time, so the servicer can stream each token the
moment it exists. Its per-sequence state lives in the Sequence (`cache`, `side`), so the store
frees, evicts and resets it with the sequence: a drafter holds nothing per sequence itself.

One module per kind: model.py (a small causal LM, and a pruned-vocabulary draft), ngram.py
(prompt lookup), feature.py (a draft over the target's hidden states), other_vocab.py (a causal LM
with its own tokenizer). No gRPC here, and nothing of the engine: the engine imports drafters,
never the reverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from draft_service.tree import TreeDraft
from specdec.kv.store import Sequence
from specdec.model.features import FeatureRows
from specdec.model.interface import ModelDescription
from specdec.calls.request import ProposeCall
from specdec.maths.tree import EMPTY_DIST, SparseDist


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One drafted token and the distribution it was drawn from (EMPTY_DIST: chosen, p = 1)."""

    token: int
    dist: SparseDist
    cumulative_prob: float
    compute_seconds: float


@runtime_checkable
class Drafter(Protocol):
    """A drafter, as the engine (draft_service/engine.py) and the loader (draft_service/loading.py)
    use it. Every attribute is declared by every drafter class, so no caller probes for one."""

    kind: str  # what GetInfo reports: "model", "ngram" or "feature"
    vocab_size: int  # the engine checks append_tokens against it; 0: any id (n-gram, another vocabulary)
    needs_features: bool  # drafts from the target's hidden states: a Propose brings them (receive)
    feature_dim: int  # ... of this width (0 without features)
    lm: ModelDescription | None  # the model the drafter runs (its `model` gets the packed GEMMs); None: no weights
    source: str | None  # where the weights were loaded from (--weights gguf reads a .gguf's blocks); None: not a file
    inline: bool  # drafting costs microseconds a token: a short call is answered on the event loop

    def receive(self, seq: Sequence, features: FeatureRows | None) -> None:
        """Takes the target features a Propose brought, after the store's sync (seq.tokens is the
        canonical sequence). Drafters without features ignore them."""
        ...

    def propose(self, seq: Sequence, call: ProposeCall, start: float) -> Iterator[Proposal]:
        """Drafts a chain after seq.tokens (at most call.draft_length tokens, stopping under
        call.min_cumulative_prob), appending each token to it as it yields it (the next call's
        known_len crops the ones the target rejected). The engine has synced the sequence and
        handed over call.features (receive). `start`: the call's perf_counter() start."""
        ...

    def propose_tree(self, seq: Sequence, call: ProposeCall, start: float) -> TreeDraft:
        """A tree of candidates after seq.tokens, shaped by call.tree, at most call.draft_length
        deep; a drafter that cannot branch sends its chain as a one-branch tree (chain_tree)."""
        ...

    def batches(self, call: ProposeCall) -> bool:
        """Whether this call can draft in forwards shared with other sequences (draft_service/
        batcher.py): only a drafter with ModelDrafter's begin/choose over an `lm` that batches."""
        ...


def chain_tree(drafter: Drafter, seq: Sequence, call: ProposeCall, start: float) -> TreeDraft:
    """The drafter's chain as a one-branch tree, for drafters that cannot branch. The drafted
    tokens stay in the sequence until the next call's known_len crops them, exactly as after a
    chain the target rejected."""
    chain = dataclasses.replace(call, draft_length=min(call.tree.budget, call.draft_length), min_cumulative_prob=0.0, tree=None)
    proposals = list(drafter.propose(seq, chain, start))
    dists = [p.dist for p in proposals]
    # every token drawn: each one's p, and none after the leaf; a chosen token anywhere: none at all (one-hot)
    child_dists = dists + [EMPTY_DIST] if dists and all(ids for ids, _ in dists) else []
    return TreeDraft(list(range(-1, len(proposals) - 1)), [p.token for p in proposals], child_dists)
