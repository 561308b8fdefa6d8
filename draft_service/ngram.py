"""Prompt-lookup (n-gram) drafting: propose what followed the last time the recent tokens appeared.

It needs no weights and costs microseconds, and it shines where the output copies the input
(summaries, edits, code). Its proposals are deterministic, so the distribution sent with each
token is one-hot, and rejection sampling stays lossless (acceptance is then just q(token)).

`NgramIndex` is what the draft service uses: an incremental index of every n-gram (min_n..max_n)
of a sequence to the position that followed its most recent occurrence, updated in O(max_n) per
token and rolled back in O(max_n) per dropped token, so a step costs the same at 100 tokens as at
100,000 (no rescan). `ngram_propose` is the same rule as a one-shot function over a token list.
"""

from __future__ import annotations


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


def ngram_propose(tokens: list[int], max_tokens: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (n from max_n down).

    Returns at most max_tokens tokens; [] when no suffix of length >= min_n occurred before.
    """
    index = NgramIndex(max_n, min_n)
    index.extend(tokens)
    return index.propose(max_tokens)[0]
