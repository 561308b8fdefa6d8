"""Staged drafting: the draft model's own greedy tokens, guessed by an n-gram index and checked in
one draft-model pass (speculative decoding applied to the draft itself).

After each token the draft model emits, the sequence's n-gram index (draft_service/drafters/ngram.py) guesses
how the draft will continue; ONE draft forward over [that token] + guess scores every guessed
position, and the longest prefix of the guess equal to the draft's own argmax is taken as drafted,
followed by the draft's argmax after it. The tokens proposed are therefore exactly the draft's
greedy chain (tests/test_staged.py checks it token for token); only the number of draft forwards
changes: down to one per accepted run of guesses, where the text repeats itself.

The index lives in `seq.side` and follows the sequence's rollback: the store crops the KV cache to
what the caller still holds, so the index is cropped to `seq.cached` on every call (checked against
the tokens) and extended from the tokens, O(new tokens) per call like the n-gram drafter's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from draft_service.drafters.base import Proposal
from specdec.maths.lookup import NgramIndex
from specdec.kv.store import Sequence
from specdec.maths.tree import EMPTY_DIST
from specdec.calls.request import ProposeCall

MAX_GUESS = 8  # guessed positions per draft forward: past a few, a wrong guess only costs compute


def _index(seq: Sequence, max_n: int) -> NgramIndex:
    index = seq.side if isinstance(seq.side, NgramIndex) and seq.side.max_n == max_n else NgramIndex(max_n, 1)
    valid = min(seq.cached, len(seq.tokens))
    if len(index) > valid:
        index.crop(valid - len(index))  # tokens past the cached prefix may have been rolled back
    if index.tokens != seq.tokens[:len(index)]:  # a list compare runs in C: cheap insurance
        index = NgramIndex(max_n, 1)
    index.extend(seq.tokens[len(index):])
    seq.side = index
    return index


def draft_staged(drafter, seq: Sequence, call: ProposeCall, start: float, max_n: int = 4) -> Iterator[Proposal]:
    """The draft's greedy proposals (same tokens as ModelDrafter._draft at temperature 0)."""
    lm = drafter.lm
    index = _index(seq, max_n)
    cumulative = 1.0
    drafter.forwards += 1
    logits = lm.forward(seq, keep=1)[0]  # [V]; feeds the catch-up tokens
    queued: list[torch.Tensor] = []  # logits already computed for the next positions (accepted guesses)
    for i in range(call.draft_length):
        token = int(logits.argmax())
        prob = float(torch.softmax(logits.float(), dim=-1)[token])
        cumulative *= prob
        if cumulative < call.min_cumulative_prob:
            return
        seq.tokens.append(token)
        index.append(token)
        yield Proposal(token, EMPTY_DIST, cumulative, time.perf_counter() - start)
        left = call.draft_length - i - 1
        if not left:
            return
        if queued:
            logits = queued.pop(0)  # the next position was scored along with an accepted guess
            continue
        guess, _ = index.propose(min(left - 1, MAX_GUESS))
        drafter.forwards += 1
        scored = lm.forward(seq, guess, keep=len(guess) + 1)  # [1 + G, V]: after the token, after each guess
        argmax = scored.argmax(dim=-1)
        agreed = 0
        while agreed < len(guess) and int(argmax[agreed]) == guess[agreed]:
            agreed += 1
        seq.crop_cache(len(seq.tokens) + agreed)  # keep the cache over the guesses that will be drafted
        queued = [scored[j] for j in range(1, agreed + 1)]
        logits = scored[0]
