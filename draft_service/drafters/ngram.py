"""Prompt-lookup (n-gram) drafting: propose what followed the last time the recent tokens appeared.

It needs no weights and costs microseconds, and it shines where the output copies the input
(summaries, edits, code). Its proposals are deterministic, so the distribution sent with each
token is one-hot, and rejection sampling stays lossless (acceptance is then just q(token)).

How long a match keeps agreeing depends on how long it is. On SmolLM2-135M-Instruct's own greedy
outputs for the benchmark prompts, the first token after a 1-token match was right 15-27% of the
time, and after a 4-token match 84-88% of the time, with long agreeing runs. `MatchCalibration`
turns that into each proposed token's probability of being right, learned online from what each
sequence turned out to be, so the coordinator can choose the draft length that pays for each match.

`NgramDrafter` is the draft service's drafter over `NgramIndex`: an incremental index of every n-gram (min_n..max_n)
of a sequence to the position that followed its most recent occurrence, updated in O(max_n) per
token and rolled back in O(max_n) per dropped token, so a step costs the same at 100 tokens as at
100,000 (no rescan). `ngram_propose` is the same rule as a one-shot function over a token list.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from draft_service.drafters.base import DraftSettings, Proposal, chain_tree
from draft_service.tree import TreeDraft, TreeSettings
from specdec.kv.store import Sequence
from specdec.model.features import FeatureRows
from specdec.spec.tree import EMPTY_DIST


class NgramIndex:
    """Suffix n-grams of one token sequence -> where their most recent continuation starts.

    Only n-grams that already have a continuation are indexed (the one ending at the last token is
    added when the next token arrives), so a lookup always finds a strictly earlier occurrence.
    Implements `crop(-k)` like a transformers cache, so `Sequence.crop_cache` rolls it back when
    the target rejects draft tokens; `len(index)` is the number of tokens it has seen.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        self._undo: list[list[tuple[tuple[int, ...], int | None]]] = []  # per token: (key, previous value)
        # The last proposal, to learn from once the sequence has moved past it (MatchCalibration):
        # (position of its first token, the token before it, the tokens, n of the match).
        self.last: tuple[int, int, list[int], int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        pos = len(self.tokens)  # the new token continues every n-gram ending just before it
        undo = []
        for n in range(self.min_n, min(self.max_n, pos) + 1):
            key = tuple(self.tokens[pos - n: pos])
            undo.append((key, self._next.get(key)))
            self._next[key] = pos
        self.tokens.append(token)
        self._undo.append(undo)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)

    def crop(self, delta: int) -> None:
        """Drops the last -delta tokens (delta < 0, the transformers Cache.crop convention)."""
        for _ in range(min(-delta, len(self.tokens))):
            self.tokens.pop()
            for key, previous in reversed(self._undo.pop()):
                if previous is None:
                    del self._next[key]
                else:
                    self._next[key] = previous

    def propose(self, max_tokens: int) -> tuple[list[int], int]:
        """(continuation, n of the matched suffix): longest suffix first, its most recent occurrence.

        When the continuation runs into the end of the sequence, the match is periodic (the suffix
        re-appears `period` tokens later), so the proposal keeps repeating that period: a loop in
        the output is drafted at full length.
        """
        length = len(self.tokens)
        if max_tokens <= 0:
            return [], 0
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._next.get(tuple(self.tokens[length - n:]))
            if start is not None:
                out = self.tokens[start: start + max_tokens]
                period = length - start
                while len(out) < max_tokens:
                    out.append(out[len(out) - period])
                return out, n
        return [], 0


# Prior hazards: P(token k right | tokens 1..k-1 right) for a match of n tokens, first token and
# later ones, rounded from the measurement quoted above (4 grounded + 4 chat prompts, 96 tokens each).
PRIOR_FIRST = {1: 0.2, 2: 0.55, 3: 0.7, 4: 0.85}
PRIOR_LATER = {1: 0.6, 2: 0.7, 3: 0.8, 4: 0.9}


class MatchCalibration:
    """P(the first k proposed tokens are all right | the match was n tokens long), learned online.

    Kept as per-(n, k) hazards (Kaplan-Meier): a proposal whose truth is known up to L tokens
    counts, for each k <= L, one trial of token k after tokens 1..k-1 agreed, and stops counting
    at its first miss. Tokens the coordinator did not verify still count, once the canonical
    sequence has reached them: they were right or wrong all the same. Shared by every sequence of
    a draft service, since they describe the target and its text. Each prior hazard starts with
    `prior_weight` pseudo-trials. Observations only move probabilities, never tokens, so a
    miscalibrated table costs speed, not correctness.
    """

    MAX_K = 32

    def __init__(self, max_n: int, prior_weight: float = 4.0):
        self.max_n = max_n
        self._hits: dict[int, list[float]] = {}
        self._trials: dict[int, list[float]] = {}
        for n in range(1, max_n + 1):
            first, later = PRIOR_FIRST[min(n, 4)], PRIOR_LATER[min(n, 4)]
            self._hits[n] = [prior_weight * (first if k == 0 else later) for k in range(self.MAX_K)]
            self._trials[n] = [prior_weight] * self.MAX_K

    def observe(self, n: int, proposal: list[int], truth: list[int]) -> None:
        """`truth`: the canonical tokens from the proposal's first position on, as far as known."""
        if n not in self._hits:
            return
        for k, (guess, actual) in enumerate(zip(proposal[: self.MAX_K], truth)):
            self._trials[n][k] += 1
            if guess != actual:
                return
            self._hits[n][k] += 1

    def survival(self, n: int, length: int) -> list[float]:
        """P(tokens 1..k all right) for k = 1..length: each proposed token's cumulative probability."""
        out: list[float] = []
        p = 1.0
        for k in range(length):
            j = min(k, self.MAX_K - 1)
            p *= self._hits[n][j] / self._trials[n][j] if n in self._hits else 0.0
            out.append(p)
        return out


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens (prompt and output). p is one-hot.

    Each sequence keeps an incremental NgramIndex in its `cache` slot: the store's rollback crops it
    like a KV cache (Sequence.crop_cache), and a step only indexes the tokens that arrived since the
    last one, so drafting costs microseconds however long the sequence grows.
    """

    kind = "ngram"
    vocab_size = 0
    needs_features = False
    feature_dim = 0
    lm = None
    source = None
    inline = True  # a few hundred catch-up tokens index in well under a millisecond

    def __init__(self, max_n: int = 4, min_n: int = 1):
        NgramIndex(max_n, min_n)  # validates the pair at start-up rather than on the first call
        self.max_n, self.min_n = max_n, min_n
        self.calibration = MatchCalibration(max_n)

    def receive(self, seq: Sequence, features: FeatureRows | None) -> None:
        """Prompt lookup reads no target features."""

    def propose_tree(self, seq: Sequence, settings: TreeSettings, start: float) -> TreeDraft:
        """One guess per position: its tree is its chain."""
        return chain_tree(self, seq, settings, start)

    def batches(self, settings: DraftSettings) -> bool:
        return False  # no forwards to share

    def propose(self, seq: Sequence, settings: DraftSettings, start: float) -> Iterator[Proposal]:
        """Each token's cumulative_prob is the calibrated chance that it and every token before it
        are right (MatchCalibration), which the coordinator weighs against the target's cost of
        checking them. The distribution sent for sampling stays one-hot: the token is certain."""
        if not isinstance(seq.cache, NgramIndex) or len(seq.cache) != seq.cached:
            seq.cache, seq.cached = NgramIndex(self.max_n, self.min_n), 0  # first call, or a state we cannot trust
        index = seq.cache
        self._learn(index, seq.tokens)
        index.extend(seq.tokens[seq.cached:])
        seq.cached = len(seq.tokens)  # drafted tokens below are not indexed; a rejection crops nothing
        proposal, n = index.propose(settings.max_tokens)
        if proposal:
            index.last = (len(seq.tokens), seq.tokens[-1], proposal, n)
        for token, cumulative in zip(proposal, self.calibration.survival(n, len(proposal))):
            seq.tokens.append(token)
            one_hot = ([token], [1.0]) if settings.temperature > 0 else EMPTY_DIST
            yield Proposal(token, one_hot, cumulative, time.perf_counter() - start)

    def _learn(self, index: NgramIndex, tokens: list[int]) -> None:
        """Scores the last proposal against the canonical tokens that have replaced it (the store
        has cropped the drafted ones and appended the verdict). Skipped when the sequence has not
        moved past it yet, or was rewound before it."""
        if index.last is None:
            return
        position, before, proposal, n = index.last
        if len(tokens) > position and tokens[position - 1] == before:
            self.calibration.observe(n, proposal, tokens[position:])
            index.last = None


def ngram_propose(tokens: list[int], max_tokens: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (n from max_n down).

    Returns at most max_tokens tokens; [] when no suffix of length >= min_n occurred before.
    """
    index = NgramIndex(max_n, min_n)
    index.extend(tokens)
    return index.propose(max_tokens)[0]
