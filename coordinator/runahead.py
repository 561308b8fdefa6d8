"""A Propose running during a Verify (overlapped speculation, coordinator/policy/overlap.py): the
bet that the target accepts the whole chain and adds the token the draft guessed, and the part of
a chain drafted ahead that the next step uses.

Apart from loop.py because it is one mechanism with a life of its own (a task, its progress, its
settlement), which the loop starts and settles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from coordinator.protocol import DraftOutcome, Progress

log = structlog.get_logger(__name__)


def _part(draft: DraftOutcome, start: int, stop: int | None = None) -> DraftOutcome:
    """tokens[start:stop] of a chain drafted ahead, its compute and bytes prorated. Its wall time
    is its compute: it spent none on this step's critical path (it arrived during the last Verify)."""
    tokens = draft.tokens[start:stop]
    if len(tokens) == len(draft.tokens):
        return draft
    share = len(tokens) / len(draft.tokens)
    compute = draft.compute_seconds * share
    confidence = None
    if draft.confidence:  # the first `start` tokens are canonical now: the rest's chances are conditional on them
        known = draft.confidence[start - 1] if start else 1.0
        confidence = [c / known for c in draft.confidence[start:stop]] if known > 0 else None
    return DraftOutcome(tokens, draft.dists[start:stop], compute, compute, int(draft.wire_bytes * share), confidence=confidence)


@dataclasses.dataclass
class RunAhead:
    """A Propose running during a Verify (coordinator/policy/overlap.py)."""

    task: asyncio.Task
    progress: Progress

    @property
    def drafted(self) -> int:
        return self.progress.tokens

    async def settle(self, full_accept: bool, next_token: int) -> tuple[DraftOutcome | None, float | None]:
        """After the verdict: the next step's draft if the bet won (the target accepted the whole
        chain and added the guessed token), else None and the seconds spent stopping it."""
        started = time.perf_counter()
        if full_accept:
            first = self.progress.first
            await asyncio.wait({first, self.task}, return_when=asyncio.FIRST_COMPLETED)
            guess = first.result() if first.done() else None
            if guess == next_token:
                try:
                    outcome = await self.task
                except Exception as exc:  # noqa: BLE001 - the draft failed while running ahead: a miss
                    log.info("run-ahead failed", error=str(exc))
                else:
                    return _part(outcome, 1), None  # the guess is canonical now: the rest is the next draft
        await self.cancel()
        return None, time.perf_counter() - started

    async def cancel(self) -> None:
        """Stops the run-ahead and waits until it has (its tokens are only ever proposals)."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
