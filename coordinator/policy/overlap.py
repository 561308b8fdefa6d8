"""When to draft ahead: the run-ahead policy of overlapped speculation (issue 10).

The draft and the target sit on different machines, so the draft can work while the target
verifies. During the Verify of step t the coordinator asks the draft to continue the chain it just
proposed: first the bonus token it expects the target to add, then the next step's draft. The bet
pays only if the target accepts the whole chain AND adds that same bonus token (a "hit"); then the
next step's draft is already in hand and its drafting time vanished from the critical path. On a
miss the run-ahead is cancelled (its tokens were only ever proposals, so nothing is lost but draft
compute) and the next step drafts from the corrected prefix as usual.

A hit is worth the drafting time it hides; a miss costs the wait for the cancelled run-ahead to
stop (the draft finishes the forward it is in) and, where draft and target share hardware, the
compute the run-ahead takes from the Verify beside it. The policy measures all three per request
and runs ahead while p(hit) * saved > miss_cost + slowdown. It has to see both schedules to know
the slowdown, so whichever one it is in, every `PROBE_EVERY`-th step tries the other.
"""

from __future__ import annotations

import dataclasses

MODES = ("off", "auto", "on")
PROBE_EVERY = 8
_EMA = 0.2  # weight of the newest observation


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


@dataclasses.dataclass
class RunAheadPolicy:
    """One request's run-ahead decisions and what it has seen. `mode`: off, auto or on."""

    mode: str = "auto"
    steps: int = 0
    ahead_steps: int = 0  # steps that ran ahead
    full_accept: float | None = None  # EMA: did the target accept every draft token
    token_accept: float | None = None  # EMA of per-token acceptance (how likely the bonus guess is right)
    hit_rate: float | None = None  # EMA over steps that ran ahead
    draft_wall: float | None = None  # seconds a step spends waiting for its draft when none is ready
    miss_wait: float | None = None  # seconds spent stopping a cancelled run-ahead
    verify_alone: float | None = None  # Verify wall seconds without / with a run-ahead beside it
    verify_beside: float | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"overlap mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def p_hit(self) -> float:
        """The chance a run-ahead is used: its observed rate once a few exist, else full
        acceptance times the chance the bonus guess is the target's token (about one more accept)."""
        if self.ahead_steps >= 3:
            return self.hit_rate
        if self.full_accept is None:
            return 0.5  # nothing seen yet: try it
        return self.full_accept * (self.token_accept if self.token_accept is not None else 0.5)

    def should_run_ahead(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        probe = self.steps % PROBE_EVERY == PROBE_EVERY - 1
        if self.draft_wall is None:
            return True  # until a step has drafted, there is nothing to weigh
        both = self.verify_beside is not None and self.verify_alone is not None
        slowdown = max(0.0, self.verify_beside - self.verify_alone) if both else 0.0
        p = self.p_hit()
        pays = p * self.draft_wall > (1 - p) * (self.miss_wait or 0.0) + slowdown
        return pays != probe  # every PROBE_EVERY-th step tries the other schedule

    def observe(self, drafted: int, accepted: int, ran_ahead: bool, hit: bool, verify_wall: float,
                draft_wall: float | None, miss_wait: float | None) -> None:
        """One step: `draft_wall` when the step waited for a fresh draft, `miss_wait` after a miss."""
        self.steps += 1
        if drafted:
            self.full_accept = _ema(self.full_accept, float(accepted == drafted))
            self.token_accept = _ema(self.token_accept, accepted / drafted)
        if ran_ahead:
            self.ahead_steps += 1
            self.hit_rate = _ema(self.hit_rate, float(hit))
            self.verify_beside = _ema(self.verify_beside, verify_wall)
        else:
            self.verify_alone = _ema(self.verify_alone, verify_wall)
        if draft_wall is not None:
            self.draft_wall = _ema(self.draft_wall, draft_wall)
        if miss_wait is not None:
            self.miss_wait = _ema(self.miss_wait, miss_wait)
