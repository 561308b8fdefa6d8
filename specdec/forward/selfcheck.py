"""The start-up check behind "numerics: exact": a row's logits do not depend on its pass.

Greedy speculation gives the target's own tokens only if a position's logits are the same bits
whether the target computes it alone (decoding), at another row of a batched pass, or beside rows
of other lengths (verifying). specdec's CPU kernel and the GPU's fixed-shape passes are built so;
a kernel library, a driver or a device can still break it (a BLAS that blocks a product by its
number of rows, an attention kernel that picks its split by the batch). So the target service
computes one row three ways before it serves and claims "exact" only if all three agree, bit for
bit (target_service/servicer.py): the claim is checked on the device in use, not assumed.
"""

from __future__ import annotations

import torch

from specdec.forward.batching import forward_batch
from specdec.kv.store import Sequence
from specdec.model.interface import LanguageModel


def _tokens(seed: int, count: int, vocab: int) -> list[int]:
    """Deterministic ids spread over the vocabulary (no tokenizer needed)."""
    return [(seed * 7919 + i * 104729) % vocab for i in range(count)]


def _prefilled(lm: LanguageModel, name: str, tokens: list[int]) -> Sequence:
    """A sequence whose cache holds all but its last token, as after a prompt's pass."""
    seq = Sequence(f"__selfcheck_{name}__", list(tokens[:-1]))
    lm.forward(seq, [], keep=1)
    seq.tokens.append(tokens[-1])
    return seq


@torch.inference_mode()
def row_exactness(lm: LanguageModel) -> str | None:
    """None when one row (a cached prompt, then a pending token and a 3-token draft) gets the same
    logits alone, first in a pass of two rows, and in the middle of a pass of three rows of other
    lengths; else which of those differed and by how much. A few small forwards."""
    vocab = lm.vocab_size
    prompt, draft = _tokens(1, 11, vocab), _tokens(2, 3, vocab)
    keep = len(draft) + 1
    alone = lm.forward(_prefilled(lm, "alone", prompt), draft, keep=keep)
    passes = {
        "first of two rows": ([_prefilled(lm, "a1", prompt), _prefilled(lm, "b1", _tokens(3, 5, vocab))],
                              [draft, _tokens(5, 1, vocab)], 0),
        "middle of three rows of other lengths": ([_prefilled(lm, "b2", _tokens(4, 17, vocab)), _prefilled(lm, "a2", prompt),
                                                   _prefilled(lm, "c2", _tokens(6, 3, vocab))],
                                                  [_tokens(7, 2, vocab), draft, []], 1),
    }
    for where, (seqs, extras, row) in passes.items():
        logits, _ = forward_batch(lm, seqs, extras, [len(extra) + 1 for extra in extras])
        if not torch.equal(logits[row], alone):
            worst = (logits[row] - alone).abs().max().item()
            return f"a row's logits differ {where} from the same row alone (by up to {worst:.3g})"
    return None
