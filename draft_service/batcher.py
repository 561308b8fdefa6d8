"""Continuous batching of draft forwards (specdec/serving/batcher.py): the chains being drafted at
once share ONE forward per token.

Under load the draft service holds many Propose streams at the same time, each asking for one
forward per drafted token; stacked as rows of one pass, the draft's weights are read once for all.
A stream registers with `opened()`, then asks `logits(seq)` once per token; a pass waits until every
open stream has asked (they come back almost at once after a pass: choosing a token and sending it
is all they do between two asks, hence the smaller share of the last pass the wait may stretch to),
or the window passes. Streams join and leave at any token: a new stream's catch-up tokens (a whole
prompt, on its first call) make its row longer, capped by `max_batch_tokens`. No ask runs directly:
the open streams, not recent calls, say who else is coming.
"""

from __future__ import annotations

import torch

from specdec.kv.store import Sequence
from specdec.serving.batcher import ContinuousBatcher


def _new_positions(seq: Sequence) -> int:
    return seq.uncached


class DraftBatcher(ContinuousBatcher[Sequence, torch.Tensor]):
    name = "draft-batcher"
    window_share = 0.1

    def __init__(self, run, forward_rows, window_s: float = 0.002, max_batch_size: int = 16, max_batch_tokens: int = 256):
        """`run(fn, *args)` awaits fn on the engine's worker; `forward_rows(seqs)` is the engine's."""
        super().__init__(run, lambda seqs, alone: forward_rows(seqs), key=id, cost=_new_positions,
                         window_s=window_s, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens)
        self._open = 0  # streams between opened() and closed(): the rows the next pass expects

    def opened(self) -> None:
        self._open += 1

    def closed(self) -> None:
        self._open = max(0, self._open - 1)
        self._arrived.set()  # the pass being gathered may have been waiting for this stream

    async def logits(self, seq: Sequence) -> torch.Tensor:
        """Feeds the sequence's pending tokens in the next pass; its next-token logits [V]."""
        return await self.submit(seq)

    def _arrive(self, seq: Sequence) -> bool:
        return False

    def _gathered(self) -> bool:
        return len(self._live()) >= min(self.max_batch_size, max(1, self._open))
