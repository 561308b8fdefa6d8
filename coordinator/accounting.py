"""What a step's verdict adds up to: the new tokens within the request's end (`_finish`: its first
end-of-sequence token, its remaining tokens), the request's statistics, and the cost model's
readings of a step's costs (`Accounting._account`).

Apart from loop.py because the bookkeeping is not the story of a step (plan, draft, verify, commit),
only what each step leaves behind. SpeculativeLoop takes Accounting's method in; it reads the
loop's `cost_model`.
"""

from __future__ import annotations

from coordinator.protocol import DraftOutcome, Stats
from specdec.maths.draft_length import DraftLengthPolicy
from specdec.calls.request import VerifyResult


def _finish(new: list[int], eos_token_ids: frozenset[int], remaining: int) -> tuple[list[int], str | None]:
    """`new` through its first end-of-sequence token and within the request's remaining tokens, and
    the finish reason if the request ends with them."""
    finish = None
    for i, token in enumerate(new):
        if token in eos_token_ids:
            new, finish = new[: i + 1], "eos"
            break
    if len(new) >= remaining:
        new, finish = new[:remaining], finish or "length"
    return new, finish



class Accounting:
    """The statistics of SpeculativeLoop (coordinator/loop.py)."""

    def _account(self, stats: Stats, policy: DraftLengthPolicy, draft: DraftOutcome, verdict: VerifyResult, appended: int,
                 asked: bool = False) -> None:
        drafted, accepted = len(draft.tokens), verdict.accepted
        depth = draft.depth  # a tree's deepest branch plays the chain's length in the policy
        stats.steps += verdict.passes  # target passes: each token decoded ahead took one, or with lookup fewer
        stats.draft_tokens += drafted + verdict.ahead_drafted
        stats.draft_steps += 1 if drafted else 0
        stats.accepted_tokens += accepted + verdict.ahead_accepted
        stats.prediction_tokens += verdict.predicted_drafted
        stats.accepted_prediction_tokens += verdict.predicted_accepted
        stats.draft_seconds += draft.compute_seconds
        stats.verify_seconds += verdict.compute_seconds
        draft_wire = max(0.0, draft.wall_seconds - draft.compute_seconds)
        verify_wire = max(0.0, verdict.wall_seconds - verdict.compute_seconds)
        stats.wire_seconds += draft_wire + verify_wire
        stats.wire_bytes += draft.wire_bytes + verdict.wire_bytes
        if len(stats.accepted_per_position) < depth:
            stats.accepted_per_position.extend([0] * (depth - len(stats.accepted_per_position)))
        for i in range(accepted):
            stats.accepted_per_position[i] += 1
        policy.observe(depth, accepted)
        # Only steady-state steps (one catch-up token) describe the per-step costs; a prefill does not.
        # An exchange that decoded ahead (it drafted nothing) ran one single-position forward per
        # token: it is a reading of V(1), and its wire is one exchange's. Leaving those out left
        # V(1) unmeasured whenever every ask of an n-gram draft was cut to nothing, since each such
        # step decodes ahead: the estimates that made the cut could then never change.
        # Passes that verified lookup drafts are not readings of V(1): left out.
        if self.cost_model is not None and appended <= 1 and not verdict.ahead_drafted:
            forwards = verdict.passes
            self.cost_model.observe(depth, draft.compute_seconds, drafted + 1, verdict.compute_seconds / forwards, verify_wire,
                                    draft_wire if asked else None)
