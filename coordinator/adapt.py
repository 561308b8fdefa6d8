"""Adaptive draft length: how many tokens to draft next, and how confident the draft must stay.

Two levers, both per request:
1. A threshold on the draft's cumulative probability, sent with each Propose: the draft stops as
   soon as the product of its tokens' probabilities falls below it. It rises after a rejection
   (draft less boldly) and falls after a full accept (draft further).
2. A cap g on the draft length that maximises expected tokens per second (Leviathan et al.):
       E(g) = (1 - a^(g+1)) / (1 - a)          tokens per step at per-token acceptance a
       T(g) = g * t_draft + V(g + 1) + t_wire    seconds per step
   with a measured from this request's verdicts, t_draft (seconds per draft token), V(n) (target
   seconds for a forward over n new tokens, fitted as V(n) = v0 + v1 * n) and t_wire from the
   steps the coordinator has timed (shared across requests: they describe the machines).

Seeded requests use the static cost priors instead of measured times, so the same seed gives the
same draft lengths, hence the same random draws, hence the same tokens on every run.
"""

from __future__ import annotations

import dataclasses
import threading


def expected_tokens(acceptance: float, gamma: int) -> float:
    """E(g): expected tokens per step (accepted drafts plus the target's own token)."""
    if acceptance >= 1.0:
        return float(gamma + 1)
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per draft token, target forward cost V(n) = verify_base + verify_per_token * n, wire per step."""

    draft_per_token: float
    verify_base: float
    verify_per_token: float
    wire_per_step: float

    def step_seconds(self, gamma: int) -> float:
        return gamma * self.draft_per_token + self.verify_base + self.verify_per_token * (gamma + 1) + self.wire_per_step


# Priors in units of one target token: a model draft costs ~0.1 of it, verifying n tokens costs
# ~1 + 0.09 (n - 1) (DESIGN.md §4 on a 2-core CPU), and the wire a few percent on loopback.
MODEL_DRAFT_PRIOR = Costs(draft_per_token=0.1, verify_base=0.91, verify_per_token=0.09, wire_per_step=0.03)
NGRAM_DRAFT_PRIOR = Costs(draft_per_token=0.002, verify_base=0.91, verify_per_token=0.09, wire_per_step=0.03)


class CostModel:
    """Running estimates of step costs, from every step of every request (thread-safe)."""

    def __init__(self, prior: Costs, decay: float = 0.95, prior_weight: float = 3.0):
        self.prior = prior
        self.decay = decay
        self._lock = threading.Lock()
        w = prior_weight
        self._draft = [prior.draft_per_token * w, w]  # [seconds, tokens]
        self._wire = [prior.wire_per_step * w, w]  # [seconds, steps]
        # Weighted least squares sums for V(n) = b0 + b1 * n, seeded with the prior at n = 1 and 8.
        self._sums = [0.0] * 5  # [sum w, sum w n, sum w n^2, sum w t, sum w n t]
        for n in (1, 8):
            self._add_verify(n, prior.verify_base + prior.verify_per_token * n, w)
        self._scaled = False

    def _add_verify(self, n: int, seconds: float, weight: float) -> None:
        s = self._sums
        for i, value in enumerate((weight, weight * n, weight * n * n, weight * seconds, weight * n * seconds)):
            s[i] = s[i] * self.decay + value

    def observe(self, drafted: int, draft_seconds: float, verified: int, verify_seconds: float, wire_seconds: float) -> None:
        with self._lock:
            if not self._scaled:
                # The priors are in target-token units; the first real step tells the unit in seconds.
                self._rescale(verify_seconds / max(self.prior.verify_base + self.prior.verify_per_token * verified, 1e-9))
            if drafted:
                self._draft = [self._draft[0] * self.decay + draft_seconds, self._draft[1] * self.decay + drafted]
            self._add_verify(verified, verify_seconds, 1.0)
            self._wire = [self._wire[0] * self.decay + wire_seconds, self._wire[1] * self.decay + 1]

    def _rescale(self, unit: float) -> None:
        self._draft[0] *= unit
        self._wire[0] *= unit
        for i in (3, 4):
            self._sums[i] *= unit
        self._scaled = True

    def costs(self) -> Costs:
        with self._lock:
            sw, sn, snn, st, snt = self._sums
            det = sw * snn - sn * sn
            slope = (sw * snt - sn * st) / det if det > 1e-12 else 0.0
            slope = max(slope, 0.0)  # a forward over more tokens never costs less
            base = (st - slope * sn) / sw
            return Costs(self._draft[0] / self._draft[1], base, slope, self._wire[0] / self._wire[1])


def best_length(acceptance: float, costs: Costs, max_length: int) -> int:
    """The draft length in [1, max_length] with the most expected tokens per second."""
    return max(range(1, max_length + 1), key=lambda g: expected_tokens(acceptance, g) / costs.step_seconds(g))


@dataclasses.dataclass
class DraftLengthPolicy:
    """One request's adaptive state. `plan()` before a step, `observe()` after it."""

    max_length: int
    cost_model: CostModel | None = None  # None: use static priors (seeded requests)
    prior: Costs = MODEL_DRAFT_PRIOR
    adaptive: bool = True
    threshold: float = 0.05  # draft's cumulative probability below which it stops drafting
    threshold_up: float = 1.5  # multiplied in after a rejection...
    threshold_down: float = 0.7  # ...and after a full accept
    threshold_bounds: tuple[float, float] = (0.005, 0.6)
    # Acceptance counts, decayed so that the estimate follows the text as it changes.
    accepted_weight: float = 2.0  # prior: a = 2 / (2 + 1) ~ 0.67
    rejected_weight: float = 1.0
    decay: float = 0.9

    @property
    def acceptance(self) -> float:
        """Per-token acceptance a: accepted trials over all trials (each step ends in <= 1 rejection)."""
        return self.accepted_weight / (self.accepted_weight + self.rejected_weight)

    def plan(self) -> tuple[int, float]:
        """(max draft tokens, min cumulative probability) for the next step."""
        if not self.adaptive or self.max_length == 0:
            return self.max_length, 0.0
        costs = self.cost_model.costs() if self.cost_model is not None else self.prior
        return best_length(self.acceptance, costs, self.max_length), self.threshold

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        rejected = 1 if accepted < drafted else 0
        self.accepted_weight = self.accepted_weight * self.decay + accepted
        self.rejected_weight = self.rejected_weight * self.decay + rejected
        low, high = self.threshold_bounds
        if rejected:
            self.threshold = min(high, self.threshold * self.threshold_up)
        else:
            self.threshold = max(low, self.threshold * self.threshold_down)
