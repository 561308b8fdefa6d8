"""Continuous batching of Verify calls (specdec/serving/batcher.py): the calls waiting when the target
frees up run as ONE verify pass.

A Verify's sequence is its sequence_id, and a row costs the positions it feeds the target (catch-up,
then draft tokens or tree nodes; of a prompt longer than a chunk, one chunk's). The batch expects
every sequence that called lately: after a pass returns, the coordinator loops each call their draft
and come back apart, and a pass started on the first of them would split them into half batches for
good. The only active sequence's call runs directly. The engine may decode ahead
(TargetEngine.verify_batch's `decode_ahead`) only for a pass that holds every active sequence's
call, the lone one's or all of them together, and stops once a call waits (`waiting`): with other
sequences active, decoding ahead would hold their next calls up.
"""

from __future__ import annotations

import operator

from specdec.serving.batcher import ContinuousBatcher
from specdec.calls.request import VerifyCall, VerifyResult


def _pass_seconds(result: VerifyResult) -> float:
    """One forward's compute, from the engine's own timing (without the thread hops): a result
    that decoded ahead took several."""
    return result.compute_seconds / (1 + result.ahead_passes)


class VerifyBatcher(ContinuousBatcher[VerifyCall, VerifyResult]):
    name = "verify-batcher"

    def __init__(self, run, verify_batch, window_s: float = 0.002, max_batch_size: int = 16, max_batch_tokens: int = 256,
                 inline=None, engine=None, settles: bool = False, joinable=None):
        """`run(fn, *args)` awaits fn on the engine's worker; `verify_batch(calls, decode_ahead)` is the engine's;
        `inline(call)`: whether a lone call may run on the event loop (ContinuousBatcher); `engine()`:
        the TargetEngine once loaded, which says what a call costs a pass (TargetEngine.pass_positions)
        and whether its passes pad their rows (None: a call costs every position it feeds, padded);
        `settles`: verify_batch answers each row decoding ahead as it finishes (its `settle`);
        `joinable(call)`: whether a call arriving during a pass is offered to it (verify_batch's `join`)."""
        self._engine = engine
        super().__init__(
            run, verify_batch,
            key=operator.attrgetter("sequence_id"),
            cost=self._positions,
            seconds=_pass_seconds,
            window_s=window_s, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens, inline=inline,
            ragged=lambda: engine is not None and engine().ragged, settles=settles, joinable=joinable,
        )

    def _positions(self, call: VerifyCall) -> int:
        return call.new_positions if self._engine is None else self._engine().pass_positions(call)
