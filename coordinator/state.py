"""One request's state between the steps of the speculative loop (coordinator/loop.py).

The loop's phases read and change it; what a single step decides travels separately (loop.Turn),
so that everything here outlives the step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import structlog

from specdec.maths.draft_length import DraftLengthPolicy
from coordinator.policy.overlap import RunAheadPolicy
from specdec.model.features import FeatureLog, FeatureRows

if TYPE_CHECKING:
    from coordinator.protocol import DraftOutcome

log = structlog.get_logger(__name__)


@dataclasses.dataclass
class SequenceState:
    """What the loop knows of one request between its steps."""

    sequence_id: str
    tokens: list[int]  # canonical: the prompt, then every token a Verify made final
    prompt_len: int
    lengths: DraftLengthPolicy  # how long this request's drafts are
    ahead: RunAheadPolicy  # whether this request's draft runs ahead during a Verify
    started: float  # time.perf_counter() when the request began
    feature_log: FeatureLog | None = None  # the target features of the canonical positions (feature drafts)
    draft_known: int = 0  # leading canonical tokens the draft holds
    target_known: int = 0  # ... the target holds
    draft_features: int = 0  # leading target features the draft holds (feature drafts)
    skip_draft_until: int = 0  # after a draft failure, the step at which the draft is asked again
    ready: DraftOutcome | None = None  # the next step's draft, drafted ahead during the last Verify
    lookup: bool = False  # the target drafts for this request itself, by prompt lookup (VerifyCall.lookup_draft_length)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def features_held(self) -> int:
        """Target features the coordinator holds: what a draft that was just sent them holds too."""
        return len(self.feature_log) if self.feature_log is not None else 0

    def forget_draft(self) -> None:
        """The draft's state is unknown (it failed mid-call): re-send everything next time."""
        self.draft_known = self.draft_features = 0

    def put_features(self, rows: FeatureRows) -> None:
        """Records the target features a Verify returned. They replace any held from `rows.start`
        on (a target that re-filled the sequence sends them again), so the draft gets them anew."""
        if rows.start <= len(self.feature_log):
            self.feature_log.put(rows)
            self.draft_features = min(self.draft_features, rows.start)
        else:  # cannot happen with a conforming target; the draft then predicts the gap itself
            log.warning("target features skip positions", start=rows.start, held=len(self.feature_log))
