"""A draft model whose tokenizer differs from the target's, speaking target ids on the wire.

The coordinator and the target never learn that the draft thinks in another vocabulary: this
drafter plugs into DraftEngine like ModelDrafter, receives the canonical TARGET tokens (the engine's
SequenceStore keeps them, with rollback), and proposes target tokens.

Its own state (`CrossState`, kept in the engine's `Sequence.cache` so it is freed, evicted and reset
with the sequence) is the draft-vocabulary tokenization of the canonical text, with the draft's KV
cache over it. When target tokens arrive, only a few trailing draft tokens are re-tokenized
(look-behind, so token boundaries line up as the draft's tokenizer would cut the text) and the KV
cache is kept for the stable prefix.

- Greedy: the draft decodes greedily in its own vocabulary; its text is re-tokenized into target
  ids (with a little canonical look-behind so the first boundary lines up), and only settled target
  tokens are proposed: the trailing one may still grow with more text (" Ber" -> " Berlin"), so it
  is dropped and the draft looks one token further instead. Any guess
  is safe: the target keeps only what equals its own argmax.
- Sampling: lossless by the intersection rule. The draft samples only among its tokens that map one
  to one to a target token (the rest masked, renormalised, then top-k as ModelDrafter does), so the
  p it sends over target ids is exactly the distribution the target token was drawn from.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterator

import torch

from draft_service.drafters.base import Proposal, chain_tree
from draft_service.tree import TreeDraft
from specdec.kv.store import Sequence
from specdec.model.features import FeatureRows
from specdec.model.lm import CausalLM
from specdec.maths.sampling import truncated_probs
from specdec.model.vocab import VocabMap, common_prefix, incomplete_tail, is_char_start
from specdec.maths.tree import EMPTY_DIST
from specdec.calls.request import ProposeCall

# Draft tokens re-tokenized behind the first changed byte: a new token can merge with a few before it.
LOOK_BEHIND = 3
# Target tokens of canonical text put in front of greedy draft text, so the first target boundary
# is cut as the target's tokenizer would cut it in context.
TARGET_LOOK_BEHIND = 2


@dataclasses.dataclass
class CrossState:
    """One sequence seen by the draft model; its KV cache lives in `draft.cache`.

    target_ids / target_ends: the canonical target tokens last seen and where each one's bytes end
    in `text`. draft.tokens / draft_ends: the draft's tokens (its prefix such as <bos> first) and
    where each one's bytes end in `draft_text`, which covers the text and any drafted continuation.
    """

    draft: Sequence
    target_ids: list[int] = dataclasses.field(default_factory=list)
    target_ends: list[int] = dataclasses.field(default_factory=list)
    text: bytearray = dataclasses.field(default_factory=bytearray)
    draft_ends: list[int] = dataclasses.field(default_factory=list)
    draft_text: bytearray = dataclasses.field(default_factory=bytearray)
    synced: int = 0  # draft_text[:synced] == text[:synced], as of the last reconcile


class CrossVocabDrafter:
    """Drafts with a causal LM over its own vocabulary; proposes target token ids."""

    kind = "model"
    # The engine checks append_tokens against this; 0 skips it: any target id is accepted (ids
    # without text, like a model's padding rows, just add no text to the draft's context).
    vocab_size = 0
    needs_features = False
    feature_dim = 0
    inline = False

    def __init__(self, lm: CausalLM, vocab: VocabMap, top_k: int = 32, source: str | None = None):
        """`source`: the file or folder the draft's weights came from (--weights gguf reads its blocks)."""
        self.lm = lm
        self.source = source
        self.vocab = vocab
        self.top_k = top_k
        draft_size = max(lm.vocab_size, len(vocab.draft))
        self.allowed = torch.zeros(draft_size, dtype=torch.bool)  # [V_draft]: the intersection
        self.allowed[list(vocab.draft_to_target)] = True
        self.allowed[lm.vocab_size:] = False  # tokenizer ids the model has no logit for
        self.to_target = torch.full((draft_size,), -1, dtype=torch.long)  # [V_draft] -> target id
        for d, t in vocab.draft_to_target.items():
            self.to_target[d] = t
        self.stop_ids = set(lm.eos_token_ids) | set(vocab.draft.special)
        # Special tokens the target can say too (same content, e.g. "<eos>"): a draft that ends
        # with one proposes the target's.
        self.shared_specials = ({vocab.target.piece(t) for t in vocab.target.special}
                                & {vocab.draft.piece(d) for d in vocab.draft.special}) - {b""}

    # -- state -----------------------------------------------------------------------------------

    def state(self, seq: Sequence) -> CrossState:
        """The sequence's draft-side state, reconciled with its canonical target tokens."""
        state = seq.cache
        if not isinstance(state, CrossState):
            prefix = list(self.vocab.draft.prefix_ids)
            state = CrossState(Sequence(seq.sequence_id, tokens=prefix), draft_ends=[0] * len(prefix))
            seq.cache, seq.cached = state, 0  # cached 0: the store only resets it (known_len 0)
        self._reconcile(state, seq.tokens)
        return state

    def _reconcile(self, state: CrossState, canonical: list[int]) -> None:
        # 1. The canonical text: keep the bytes of the target tokens still agreed on, add the new.
        kept = common_prefix(state.target_ids, canonical)
        del state.target_ids[kept:], state.target_ends[kept:]
        end = state.target_ends[-1] if state.target_ends else 0
        del state.text[end:]
        for token in canonical[kept:]:
            state.text += self.vocab.target.piece(token)
            state.target_ids.append(token)
            state.target_ends.append(len(state.text))
        # 2. Where the draft's text stops agreeing with it.
        lo = min(state.synced, end)
        agree = lo + common_prefix(state.draft_text[lo:], state.text[lo:])
        # 3. Keep the draft tokens inside the agreed text, minus a look-behind, cut at a character.
        prefix = len(self.vocab.draft.prefix_ids)
        keep = max(prefix, bisect.bisect_right(state.draft_ends, agree) - LOOK_BEHIND)
        while keep > prefix and not is_char_start(state.text, state.draft_ends[keep - 1]):
            keep -= 1
        start = state.draft_ends[keep - 1] if keep else 0
        fresh = self.vocab.draft.encode(bytes(state.text[start:]), lossy=True) or []
        old_tail = state.draft.tokens[keep:]
        # 4. The KV cache stays valid for the tokens the re-tokenization reproduced.
        stable = keep + common_prefix(old_tail, fresh)
        draft = state.draft
        draft.tokens[keep:] = fresh
        del state.draft_ends[keep:], state.draft_text[start:]
        for token in fresh:
            state.draft_text += self.vocab.draft.piece(token)
            state.draft_ends.append(len(state.draft_text))
        draft.crop_cache(min(stable, len(draft.tokens) - 1))
        state.synced = start + common_prefix(state.draft_text[start:], state.text[start:])

    # -- drafting --------------------------------------------------------------------------------

    def receive(self, seq: Sequence, features: FeatureRows | None) -> None:
        """A draft in another vocabulary reads no target features."""

    def propose_tree(self, seq: Sequence, call: ProposeCall, start: float) -> TreeDraft:
        """Its tokens come from re-tokenized text, not one draft position each: a chain only."""
        return chain_tree(self, seq, call, start)

    def batches(self, call: ProposeCall) -> bool:
        return False  # its forwards run over its own vocabulary's sequence, not the store's

    def propose(self, seq: Sequence, call: ProposeCall, start: float) -> Iterator[Proposal]:
        state = self.state(seq)
        if state.synced != len(state.text) or len(state.draft_text) != len(state.text) or not state.draft.tokens:
            return  # the draft cannot represent the canonical text exactly: nothing to build on
        if call.temperature == 0:
            yield from self._greedy(seq, state, call, start)
        else:
            yield from self._sample(seq, state, call, start)

    def _sample(self, seq: Sequence, state: CrossState, call: ProposeCall, start: float) -> Iterator[Proposal]:
        generator = torch.Generator().manual_seed(call.seed)
        cumulative = 1.0
        for _ in range(call.draft_length):
            if cumulative < call.min_cumulative_prob:
                return  # decided before the draw: a cut by the drawn token's own p would bias it (ModelDrafter.choose)
            logits = self.lm.forward(state.draft, keep=1)[0]  # [V_draft]
            masked = logits.masked_fill(~self.allowed[: logits.shape[-1]], float("-inf"))  # [V_draft]
            k = min(self.top_k, int(self.allowed[: logits.shape[-1]].sum()))
            top_ids, top_probs = truncated_probs(masked, call.temperature, k)  # [k], [k]
            choice = int(torch.multinomial(top_probs, 1, generator=generator))
            token, prob = int(top_ids[choice]), float(top_probs[choice])
            cumulative *= prob
            target = int(self.to_target[token])
            self._append_draft(state, token)
            seq.tokens.append(target)
            yield Proposal(target, (self.to_target[top_ids].tolist(), top_probs.tolist()), cumulative,
                           time.perf_counter() - start)

    def _greedy(self, seq: Sequence, state: CrossState, call: ProposeCall, start: float) -> Iterator[Proposal]:
        anchor = len(state.text)  # drafted text starts here
        context = self._target_context(state)
        proposed: list[int] = []
        cumulative = 1.0
        # A target token needs the text of the next one to be settled; the draft's tokens are about
        # as long as the target's, so twice as many draft steps plus a few is plenty.
        for _ in range(2 * call.draft_length + 4):
            logits = self.lm.forward(state.draft, keep=1)[0]  # [V_draft]
            token = int(logits.argmax())
            cumulative *= float(torch.softmax(logits.float(), dim=-1)[token])
            if cumulative < call.min_cumulative_prob:
                break
            final = token in self.stop_ids  # the draft says its text ends here
            if not final or self.vocab.draft.piece(token) in self.shared_specials:
                self._append_draft(state, token)  # an end the target cannot say is left out
            settled = self._settled(state, anchor, context, final)
            if settled is None or settled[: len(proposed)] != proposed:
                return  # the text cannot be said in target tokens, or an earlier boundary moved
            for target in settled[len(proposed): call.draft_length]:
                proposed.append(target)
                seq.tokens.append(target)
                yield Proposal(target, EMPTY_DIST, cumulative, time.perf_counter() - start)
            if final or len(proposed) >= call.draft_length:
                return

    def _target_context(self, state: CrossState) -> int:
        """Byte offset a few target tokens back, at a token start that is also a character start."""
        n = len(state.target_ends)
        back = max(0, n - TARGET_LOOK_BEHIND)
        while back > 0 and not is_char_start(state.text, state.target_ends[back - 1]):
            back -= 1
        return state.target_ends[back - 1] if back else 0

    def _settled(self, state: CrossState, anchor: int, context: int, final: bool) -> list[int] | None:
        """Target ids for the drafted text whose boundaries more text cannot move."""
        drafted = bytes(state.draft_text[anchor:])
        if not final:
            drafted = drafted[: len(drafted) - incomplete_tail(drafted)]
        if not drafted:
            return []
        target = self.vocab.target
        window = bytes(state.text[context:anchor]) + drafted
        ids = target.encode(window)
        offset, split = 0, None
        for i, token in enumerate(ids or ()):
            if offset == anchor - context:
                split = i
                break
            offset += len(target.piece(token))
        if split is None:  # the look-behind merged across the boundary: the drafted text alone
            ids, split = target.encode(drafted), 0
            if ids is None:
                return None
        out = ids[split:]
        return out if final else out[:-1]

    def _append_draft(self, state: CrossState, token: int) -> None:
        state.draft.tokens.append(token)
        state.draft_text += self.vocab.draft.piece(token)
        state.draft_ends.append(len(state.draft_text))


def build_cross_drafter(lm: CausalLM, draft_tokenizer, draft_spec: str, target_tokenizer: str, top_k: int,
                        source: str | None = None) -> CrossVocabDrafter | None:
    """Loads the target's tokenizer and maps the two vocabularies; clear errors when it cannot.

    None when both tokenizers turn out identical (same pieces, same specials): the plain
    ModelDrafter then serves, with no mapping cost (`specdec up` passes the target's tokenizer
    whenever the draft is another model, which may well share the target's vocabulary).

    Blocking (reads tokenizer files, walks both vocabularies): call it off the event loop, as
    draft_service.loading.load_engine is.
    """
    from specdec.model.loading import load_tokenizer
    from specdec.model.vocab import TokenText

    if draft_tokenizer is None:
        raise ValueError(f"--target-tokenizer needs the draft model's own tokenizer, and {draft_spec!r} has none")
    try:
        target = load_tokenizer(target_tokenizer)
    except (OSError, ValueError) as e:
        raise ValueError(f"--target-tokenizer {target_tokenizer!r} cannot be loaded: {e}") from e
    draft_text = TokenText.from_tokenizer(draft_tokenizer, lm.vocab_size)
    target_text = TokenText.from_tokenizer(target)
    if draft_text.pieces[: len(target_text)] == target_text.pieces and draft_text.special == target_text.special:
        return None
    vocab = VocabMap.build(draft_text, target_text)
    return CrossVocabDrafter(lm, vocab, top_k, source)
