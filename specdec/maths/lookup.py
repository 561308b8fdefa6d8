"""Prompt lookup over a sequence's own tokens, the part both services use.

The draft service drafts with it (draft_service/drafters/ngram.py), and the target drafts with it
itself on the passes that have no draft of their own (target_service/engine.py, VerifyCall.lookup_draft_length): an
n-gram draft then costs no exchange with a draft service or with the coordinator, the round trip
that dominates a step once the forward itself is fast. Pure Python over token ids: no model, no gRPC.
"""

from __future__ import annotations

import functools
import math

from specdec.maths.costs import Costs

# Longest suffix the target's prompt lookup matches: the n-gram drafter's default (draft_service/config.py).
LOOKUP_MAX_N = 4


def in_source(n: int, max_n: int = LOOKUP_MAX_N) -> bool:
    """Whether a match NgramIndex.propose reported as `n` was in its source (it counts those as n + max_n)."""
    return n > max_n


class NgramIndex:
    """Suffix n-grams of one token sequence -> where their most recent continuation starts.

    Only n-grams that already have a continuation are indexed (the one ending at the last token is
    added when the next token arrives), so a lookup always finds a strictly earlier occurrence.
    Implements `crop(-k)` like a transformers cache, so `Sequence.crop_cache` rolls it back when
    the target rejects draft tokens; `len(index)` is the number of tokens it has seen.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1, source: tuple[int, ...] = ()):
        """`source`: tokens to draft from besides the sequence's own (a request's predicted output):
        its n-grams are indexed first, so the sequence's own later occurrences take precedence, and
        rolling the sequence back restores them. `tokens` and len() stay the sequence's alone."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # n-gram -> index of the token that followed it last; ~i (negative) for source[i]
        self._next: dict[tuple[int, ...], int] = {}
        self.source = tuple(source)
        for pos in range(1, len(self.source)):
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                self._next[self.source[pos - n: pos]] = ~pos
        self._undo: list[list[tuple[tuple[int, ...], int | None]]] = []  # per token: (key, previous value)
        self.odds = MatchOdds()  # this sequence's luck against the shared calibration (not rolled back by crop)
        self.rest = 0  # passes whose lookup this sequence skips (rests)
        self.empties = 0  # lookups in a row that drafted nothing (looked)
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

    def extend(self, tokens: list[int], indexed: int | None = None) -> None:
        """Appends `tokens`, indexing the n-grams of only the last `indexed` of them (None: all).
        Why: a sequence that rested its lookups (`rests`) catches up cheaply; matches into the
        stretch left out are lost, which drafts less, never wrongly."""
        skipped = 0 if indexed is None else max(0, len(tokens) - indexed)
        for t in tokens[:skipped]:
            self.tokens.append(t)
            self._undo.append([])
        for t in tokens[skipped:]:
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

    def propose(self, draft_length: int) -> tuple[list[int], int]:
        """(continuation, n of the matched suffix): longest suffix first, its most recent occurrence;
        n + max_n where the match is in the source.

        When the continuation runs into the end of the sequence, the match is periodic (the suffix
        re-appears `period` tokens later), so the proposal keeps repeating that period: a loop in
        the output is drafted at full length.
        """
        length = len(self.tokens)
        if draft_length <= 0:
            return [], 0
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._next.get(tuple(self.tokens[length - n:]))
            if start is not None and start < 0:  # in the source: its continuation, as far as it goes,
                # and its match counted as n + max_n: a prediction's chances are learned apart
                # (MatchCalibration) from the sequence's own repeats, which other requests draft by
                return list(self.source[~start: ~start + draft_length]), n + self.max_n
            if start is not None:
                out = self.tokens[start: start + draft_length]
                period = length - start
                while len(out) < draft_length:
                    out.append(out[len(out) - period])
                return out, n
        return [], 0


# Prior hazards: P(token k right | tokens 1..k-1 right) for a match of n tokens, first token and
# later ones, rounded from the measurement quoted above (4 grounded + 4 chat prompts, 96 tokens each).
PRIOR_FIRST = {1: 0.2, 2: 0.55, 3: 0.7, 4: 0.85}
PRIOR_LATER = {1: 0.6, 2: 0.7, 3: 0.8, 4: 0.9}


class MatchOdds:
    """One sequence's first-token hits against what the shared calibration expected of them: a
    factor on the calibration's chances for this sequence's proposals.

    Why: MatchCalibration is shared by every sequence (it learns a match length's chances from all
    of them), so a request whose text repeats less than the others' (arithmetic, where a 1-token
    match is a digit or an operator) had its matches drafted on the others' odds: 1-token matches
    drafted 2-3 long, right about one time in ten, each pass slower than no draft. Every proposal
    made counts, drafted or not, since its first token's truth is known once the sequence moves on.
    The factor starts at 1 (`prior` expected hits' worth of agreement) and follows the text (`decay`)."""

    def __init__(self, prior: float = 1.0, decay: float = 0.95):
        self.prior, self.decay = prior, decay
        self.hits = 0.0
        self.expected = 0.0

    def observe(self, expected: float, hit: bool) -> None:
        self.hits = self.hits * self.decay + hit
        self.expected = self.expected * self.decay + expected

    def factor(self) -> float:
        return (self.hits + self.prior) / (self.expected + self.prior)


class MatchCalibration:
    """P(the first k proposed tokens are all right | the match was n tokens long), learned online.

    Kept as per-(n, k) hazards (Kaplan-Meier): a proposal whose truth is known up to L tokens
    counts, for each k <= L, one trial of token k after tokens 1..k-1 agreed, and stops counting
    at its first miss. Tokens the coordinator did not verify still count, once the canonical
    sequence has reached them: they were right or wrong all the same. Shared by every sequence of
    a service (the draft service's n-gram drafter, or the target's engine), since they describe the
    target and its text. Each prior hazard starts with
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

    def observe(self, n: int, proposal: list[int], truth: list[int], odds: MatchOdds | None = None) -> None:
        """`truth`: the canonical tokens from the proposal's first position on, as far as known.
        `odds`: the proposing sequence's, which learns its first token's outcome."""
        if n not in self._hits:
            return
        if odds is not None and proposal and truth:
            odds.observe(self._hits[n][0] / self._trials[n][0], proposal[0] == truth[0])
        for k, (guess, actual) in enumerate(zip(proposal[: self.MAX_K], truth)):
            self._trials[n][k] += 1
            if guess != actual:
                return
            self._hits[n][k] += 1

    def first(self, n: int) -> float:
        """The chance that the first token of a match of n tokens is right."""
        return self._hits[n][0] / self._trials[n][0] if n in self._hits else 0.0

    def survival(self, n: int, length: int, odds: MatchOdds | None = None) -> list[float]:
        """P(tokens 1..k all right) for k = 1..length: each proposed token's cumulative probability;
        with `odds`, its first token's chance taken to that sequence's own (MatchOdds)."""
        out: list[float] = []
        p = 1.0 if odds is None else odds.factor()
        for k in range(length):
            j = min(k, self.MAX_K - 1)
            p *= self._hits[n][j] / self._trials[n][j] if n in self._hits else 0.0
            out.append(min(p, 1.0))
        return out


def best_cut(confidence: list[float], relative: list[float] | tuple[float, ...]) -> int:
    """How many tokens of a proposal to verify (0..len): the prefix with the most expected tokens
    per unit of forward cost, where confidence[k - 1] is the chance its first k tokens are all
    right and relative[g] the cost of a forward over g + 1 positions against one over 1 (the
    target's own pass: no draft to pay for, no exchange). Empty `relative`: all of it."""
    if not relative:
        return len(confidence)
    best, best_rate, expected = 0, 1.0 / relative[0], 1.0
    for g, p in enumerate(confidence[: len(relative) - 1], start=1):
        expected += p
        rate = expected / relative[g]
        if rate > best_rate:
            best, best_rate = g, rate
    return best


@functools.lru_cache(maxsize=64)
def pays_from(relative: tuple[float, ...]) -> float:
    """The first-token chance under which no cut of any proposal pays (best_cut returns 0): a
    proposal's k-th token is right at most as often as its first, so g drafted tokens add at most
    g * p expected tokens for relative[g] / relative[0] - 1 more cost. Cached: a pass asks it for
    every row with the same costs."""
    if len(relative) < 2:
        return math.inf
    return min((relative[g] / relative[0] - 1.0) / g for g in range(1, len(relative)))


# Most passes a sequence's lookup rests after lookups that drafted nothing, as the coordinator's
# n-gram policy rests after empty asks (specdec/maths/draft_length.py, max_rest): 1, 2, 4, then 8.
MAX_LOOKUP_REST = 8


def rests(index: NgramIndex) -> bool:
    """Whether this pass skips the sequence's lookup (and the indexing of its new tokens): it is
    resting after lookups that drafted nothing. Why: where many rows share a pass and the text does
    not repeat itself, every lookup is cut to nothing, yet indexing, matching and cutting it cost the
    target's worker a sizeable share of a row's pass (benchmarks/results/lookup-rests/). Only drafts
    are skipped, never tokens: a rested pass is a pass with no draft."""
    if index.rest:
        index.rest -= 1
        return True
    return False


def looked(index: NgramIndex, drafted: int) -> None:
    """After a lookup that drafted `drafted` tokens: a draft ends the rests, each lookup in a row
    that drafted nothing doubles the next rest, up to MAX_LOOKUP_REST."""
    index.empties = 0 if drafted else index.empties + 1
    index.rest = min(MAX_LOOKUP_REST, 2 ** (index.empties - 1)) if index.empties else 0


def relative_costs(costs: Costs, draft_length: int) -> tuple[float, ...]:
    """V(n) / V(1) for n = 1..draft_length + 1: what VerifyCall.lookup_costs carries."""
    v = costs.verify
    return tuple(v[min(n, len(v)) - 1] / v[0] for n in range(1, draft_length + 2))


def lookup_draft(index: NgramIndex, calibration: MatchCalibration, draft_length: int, relative: tuple[float, ...],
                 room: int) -> tuple[list[int], list[int], int]:
    """(draft, the whole proposal, n of its match): what `index` proposes after its longest matched
    suffix, cut by `calibration`'s chances and the `relative` costs; ([], [], 0) without a match."""
    proposal, n = index.propose(min(draft_length, room))
    if not n:
        return [], [], 0
    if relative and calibration.first(n) * index.odds.factor() <= pays_from(relative):
        return [], proposal, n  # what best_cut would say, without working the chances out
    return proposal[: best_cut(calibration.survival(n, len(proposal), index.odds), relative)], proposal, n
