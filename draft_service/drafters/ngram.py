"""Prompt-lookup (n-gram) drafting: propose what followed the last time the recent tokens appeared.

It needs no weights and costs microseconds, and it shines where the output copies the input
(summaries, edits, code). Its proposals are deterministic, so the distribution sent with each
token is one-hot, and rejection sampling stays lossless (acceptance is then just q(token)).

How long a match keeps agreeing depends on how long it is. On SmolLM2-135M-Instruct's own greedy
outputs for the benchmark prompts, the first token after a 1-token match was right 15-27% of the
time, and after a 4-token match 84-88% of the time, with long agreeing runs. `MatchCalibration`
turns that into each proposed token's probability of being right, learned online from what each
sequence turned out to be, so the coordinator can choose the draft length that pays for each match.

`NgramDrafter` is the draft service's drafter over `NgramIndex` (specdec/maths/lookup.py, shared
with the target, which drafts with it on the passes it decodes ahead): an incremental index of every n-gram (min_n..max_n)
of a sequence to the position that followed its most recent occurrence, updated in O(max_n) per
token and rolled back in O(max_n) per dropped token, so a step costs the same at 100 tokens as at
100,000 (no rescan). `ngram_propose` is the same rule as a one-shot function over a token list.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from draft_service.drafters.base import Proposal, chain_tree
from draft_service.tree import TreeDraft
from specdec.kv.store import Sequence
from specdec.model.features import FeatureRows
from specdec.maths.lookup import MatchCalibration, NgramIndex
from specdec.maths.tree import EMPTY_DIST
from specdec.calls.request import ProposeCall


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

    def propose_tree(self, seq: Sequence, call: ProposeCall, start: float) -> TreeDraft:
        """One guess per position: its tree is its chain."""
        return chain_tree(self, seq, call, start)

    def batches(self, call: ProposeCall) -> bool:
        return False  # no forwards to share

    def propose(self, seq: Sequence, call: ProposeCall, start: float) -> Iterator[Proposal]:
        """Each token's cumulative_prob is the calibrated chance that it and every token before it
        are right (MatchCalibration), which the coordinator weighs against the target's cost of
        checking them. The distribution sent for sampling stays one-hot: the token is certain."""
        if not isinstance(seq.cache, NgramIndex) or len(seq.cache) != seq.cached:
            seq.cache, seq.cached = NgramIndex(self.max_n, self.min_n), 0  # first call, or a state we cannot trust
        index = seq.cache
        self._learn(index, seq.tokens)
        index.extend(seq.tokens[seq.cached:])
        seq.cached = len(seq.tokens)  # drafted tokens below are not indexed; a rejection crops nothing
        proposal, n = index.propose(call.draft_length)
        if proposal:
            index.last = (len(seq.tokens), seq.tokens[-1], proposal, n)
        for token, cumulative in zip(proposal, self.calibration.survival(n, len(proposal), index.odds)):
            seq.tokens.append(token)
            one_hot = ([token], [1.0]) if call.temperature > 0 else EMPTY_DIST
            yield Proposal(token, one_hot, cumulative, time.perf_counter() - start)

    def _learn(self, index: NgramIndex, tokens: list[int]) -> None:
        """Scores the last proposal against the canonical tokens that have replaced it (the store
        has cropped the drafted ones and appended the verdict). Skipped when the sequence has not
        moved past it yet, or was rewound before it."""
        if index.last is None:
            return
        position, before, proposal, n = index.last
        if len(tokens) > position and tokens[position - 1] == before:
            self.calibration.observe(n, proposal, tokens[position:], index.odds)
            index.last = None


def ngram_propose(tokens: list[int], draft_length: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (n from max_n down).

    Returns at most draft_length tokens; [] when no suffix of length >= min_n occurred before.
    """
    index = NgramIndex(max_n, min_n)
    index.extend(tokens)
    return index.propose(draft_length)[0]
