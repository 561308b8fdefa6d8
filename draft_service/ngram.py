"""Prompt-lookup (n-gram) drafting: propose what followed the last time the recent tokens appeared.

It needs no weights and costs microseconds, and it shines where the output copies the input
(summaries, edits, code). Its proposals are deterministic, so the distribution sent with each
token is one-hot, and rejection sampling stays lossless (acceptance is then just q(token)).
"""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: list[int], max_tokens: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (n from max_n down).

    Returns at most max_tokens tokens; [] when no suffix of length >= min_n occurred before.
    """
    length = len(tokens)
    if max_tokens <= 0 or length < 2:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        # Candidate starts: every window of length n that ends before the suffix itself begins.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < length]  # a match must have at least one token after it
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence predicts best
            return seq[start : start + max_tokens].tolist()
    return []
