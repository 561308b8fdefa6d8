"""Drafting with a small causal LM (`ModelDrafter`), and loading a pruned-vocabulary draft as one.

Truncating to top-k is what makes the sparse p on the wire exact (see sampling.truncated_probs).
Token choice is split from the forward (`begin`, `choose`), so the batched path
(draft_service/batcher.py) draws exactly what the one-sequence path draws, and the feature draft
(feature.py) reuses it over its own forwards.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from draft_service.drafters.base import Proposal
from draft_service.drafters.staged import draft_staged
from draft_service.tree import TreeBuilder, TreeDraft
from specdec.forward.batching import batchable
from specdec.kv.store import Sequence
from specdec.model.features import FeatureRows
from specdec.model.interface import LanguageModel
from specdec.maths.sampling import truncated_probs
from specdec.maths.tree import EMPTY_DIST
from specdec.calls.request import ProposeCall


class ModelDrafter:
    """Drafts with a small causal LM, sampling from its top-k truncated distribution.

    Truncating to top-k is what makes the sparse p on the wire exact (see sampling.truncated_probs);
    with temperature 0 it proposes the argmax and sends no distribution. `staged`: greedy drafts
    are themselves speculated by an n-gram index (draft_service/drafters/staged.py), the same tokens in
    fewer draft forwards.
    """

    kind = "model"
    needs_features = False
    feature_dim = 0
    inline = False

    def __init__(self, lm: LanguageModel, top_k: int = 32, staged: bool = False, source: str | None = None):
        """`source`: the file or folder the weights came from (--weights gguf reads its blocks)."""
        self.lm = lm
        self.top_k = top_k
        self.vocab_size = lm.vocab_size
        self.staged = staged
        self.source = source
        self.forwards = 0  # draft-model forward passes so far (staged drafting saves some)
        self._batchable: bool | None = None  # known after the first look at the model's cache layout

    def receive(self, seq: Sequence, features: FeatureRows | None) -> None:
        """A plain model draft reads no target features."""

    def propose(self, seq: Sequence, call: ProposeCall, start: float) -> Iterator[Proposal]:
        if self.staged and call.temperature == 0:
            return draft_staged(self, seq, call, start)
        return self._draft(seq, call, start)

    def propose_tree(self, seq: Sequence, call: ProposeCall, start: float) -> TreeDraft:
        return TreeBuilder(self.lm, seq, call, self.top_k).build()

    def batches(self, call: ProposeCall) -> bool:
        """A plain model draft over a model whose caches line up position by position, unless it
        is staged and greedy (staged drafting speculates its own forwards)."""
        if self._batchable is None:
            self._batchable = batchable(self.lm)
        return self._batchable and not (self.staged and call.temperature == 0)

    def _draft(self, seq: Sequence, call: ProposeCall, start: float) -> Iterator[Proposal]:
        state = self.begin(call, start)
        self.forwards += 1
        logits = self.lm.forward(seq, keep=1)[0]  # [V]; feeds the catch-up tokens
        while (proposal := self.choose(logits, state)) is not None:
            seq.tokens.append(proposal.token)
            yield proposal
            if state.done:
                return
            self.forwards += 1
            logits = self.lm.forward(seq, keep=1)[0]

    def begin(self, call: ProposeCall, start: float) -> ChainState:
        return ChainState(call, start, torch.Generator().manual_seed(call.seed))

    def choose(self, logits: torch.Tensor, state: ChainState, ids: torch.Tensor | None = None) -> Proposal | None:
        """The next draft token from the logits [V] that follow the chain so far; None: stop here.
        `ids`: the token id of each logit where they cover only some tokens (a pruned head; every
        other token's probability is 0); None: logit i is token i's.

        Split from the forward so the batched path (draft_service/batcher.py) draws exactly what
        the one-sequence path draws: the same generator, the same order of draws.

        The cumulative-probability stop must not look at the token it would cut when sampling:
        dropping a drawn token x because q(x) was small makes the proposals follow q restricted to
        the tokens that pass, while the target is told they follow q, and the output is no longer
        the target's distribution. So a sampled token is always kept, and the chain stops AFTER
        the token that takes the product under the threshold (`state.done`): whether token i+1 is
        drawn depends only on tokens 1..i. Greedy tokens are no draw, so there the token that
        would fall under the threshold is left out, which is cheaper and harmless.
        """
        call = state.call
        if state.done:
            return None
        if call.temperature == 0:
            index = int(logits.argmax())
            prob = float(torch.softmax(logits.float(), dim=-1)[index])  # the draft's confidence
            token = index if ids is None else int(ids[index])
            if state.cumulative * prob < call.min_cumulative_prob:
                state.stopped = True  # not confident enough: verifying it would likely waste the slot
                return None
            dist = EMPTY_DIST
        else:
            top_ids, top_probs = truncated_probs(logits, call.temperature, self.top_k)
            top_ids = top_ids if ids is None else ids[top_ids]
            choice = int(torch.multinomial(top_probs, 1, generator=state.generator))
            token, prob = int(top_ids[choice]), float(top_probs[choice])
            dist = (top_ids.tolist(), top_probs.tolist())
        state.cumulative *= prob
        state.drafted += 1
        if state.cumulative < call.min_cumulative_prob:
            state.stopped = True  # decided from tokens 1..i, before token i+1 is drawn
        return Proposal(token, dist, state.cumulative, time.perf_counter() - state.start)


@dataclasses.dataclass
class ChainState:
    """One Propose call's drafting state between forwards."""

    call: ProposeCall
    start: float
    generator: torch.Generator
    cumulative: float = 1.0
    drafted: int = 0
    stopped: bool = False  # the cumulative-probability stop fired (see ModelDrafter.choose)

    @property
    def done(self) -> bool:
        """No further token is to be drawn: the stop fired or the proposal is full."""
        return self.stopped or self.drafted >= self.call.draft_length


def load_pruned_drafter(folder, device: str = "auto", dtype: str = "auto", top_k: int = 32, staged: bool = False) -> ModelDrafter:
    """A ModelDrafter over a distilled pruned-vocabulary draft (specdec/model/pruned.py).

    Its logits come back in the target's vocabulary with -inf outside the kept ids, so greedy
    drafting and top-k sampling are the plain ModelDrafter's, and tokens off the head get p = 0.
    """
    from specdec.model.loading import resolve_device, resolve_dtype
    from specdec.model.pruned import PrunedCausalLM, load_draft

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model, meta = load_draft(folder, dev, dt)
    return ModelDrafter(PrunedCausalLM(model, dev, meta.get("eos_token_ids")), top_k, staged)
