"""The cost model of a speculative step: expected tokens E(g), step seconds T(g), and the draft
length or proposal prefix that maximises tokens per second. Pure functions over measured costs,
plus CostModel, the running estimate of those costs that every request's steps feed.

       E(g) = (1 - a^(g+1)) / (1 - a)                   tokens per step at per-token acceptance a
       T(g) = [g > 0] (t_ask + g * t_draft) + V(g + 1) + t_wire   seconds per step
(Leviathan et al.), with t_ask the draft exchange's round trip, t_draft seconds per draft token,
V(n) target seconds for a forward over n new tokens (kept per n and fitted non-decreasing) and
t_wire the target exchange's. For a draft whose cumulative probabilities are calibrated (the n-gram
drafter's), E(g) = 1 + the sum of its first g cumulative probabilities (best_prefix).

How a request uses them (the threshold, probes, rests): coordinator/policy/draft_length.py.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from specdec.limits import MAX_VERIFY_POSITIONS


def expected_tokens(acceptance: float, gamma: int) -> float:
    """E(g): expected tokens per step (accepted drafts plus the target's own token)."""
    if acceptance >= 1.0:
        return float(gamma + 1)
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)




@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per draft token, target forward cost V(n) for n = 1..33 new positions, the target
    exchange's wire per step, and what asking the draft costs a step besides its tokens (the draft
    exchange's round trip: only steps that draft pay it)."""

    draft_per_token: float
    verify: tuple[float, ...]  # verify[n - 1] = V(n)
    wire_per_step: float
    draft_per_ask: float = 0.0

    def step_seconds(self, gamma: int) -> float:
        drafting = self.draft_per_ask + gamma * self.draft_per_token if gamma else 0.0
        return drafting + self.verify[gamma] + self.wire_per_step


def cost_curve(single: float, jump: float, per_token: float) -> tuple[float, ...]:
    """V(1) = single; V(n >= 2) = single * jump + per_token * (n - 2).

    On CPUs a forward over 2 tokens costs more than over 1 (a matrix-vector product gives way to
    a matrix-matrix one), then grows slowly: SmolLM2-135M on 2 cores with specdec's small-M kernel
    measured V(2) = 1.2 V(1), V(9) = 1.5 V(1), V(16) = 2.0 V(1) (docs/benchmarks.md). On GPUs the
    jump is near 1. Measurements replace these priors as steps are timed.
    """
    return tuple(single if n == 1 else single * jump + per_token * (n - 2) for n in range(1, MAX_VERIFY_POSITIONS + 1))


def monotone(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent
    violators). A forward over more positions never costs less, but cells of V(n) learn at their
    own pace: a policy that only ever drafted 5 tokens measured V(6) = 30 ms while V(2..5) still
    held the prior's 42-45 ms, so 5 looked cheaper than 1..4 and stayed the only length tried."""
    blocks: list[list[float]] = []  # [weighted sum, weight, cells]
    for value, weight in zip(values, weights):
        blocks.append([value * weight, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, w, cells = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += w
            blocks[-1][2] += cells
    return [total / w for total, w, cells in blocks for _ in range(cells)]


# Priors in units of one target token, as on a 2-core CPU: a model draft costs ~0.1 of it,
# an n-gram lookup next to nothing, each exchange's wire a few percent on loopback.
MODEL_DRAFT_PRIOR = Costs(draft_per_token=0.1, verify=cost_curve(1.0, 1.2, 0.05), wire_per_step=0.03, draft_per_ask=0.03)
NGRAM_DRAFT_PRIOR = Costs(draft_per_token=0.002, verify=cost_curve(1.0, 1.2, 0.05), wire_per_step=0.03, draft_per_ask=0.03)


class CostModel:
    """Running estimates of step costs from every step of every request (thread-safe).

    Each quantity is a decayed mean seeded with the prior at weight `prior_weight`; V(n) is kept per
    n, since its shape (the 1 -> 2 jump on CPUs) is what decides whether drafting pays at all.
    """

    def __init__(self, prior: Costs, decay: float = 0.97, prior_weight: float = 2.0):
        self.prior = prior
        self.decay = decay
        self._lock = threading.Lock()
        w = prior_weight
        self._draft = [prior.draft_per_token * w, w]  # [decayed seconds, decayed tokens]
        self._wire = [prior.wire_per_step * w, w]  # [decayed seconds, decayed steps]
        self._ask = [prior.draft_per_ask * w, w]  # [decayed seconds, decayed asks]
        self._verify = [[v * w, w] for v in prior.verify]  # per n: [decayed seconds, decayed count]
        self._scaled = False
        # Most draft tokens a request may verify per step under the current load (set by the
        # coordinator's scheduler: coordinator/policy/admission.py); None: no load cap.
        self.draft_cap: Callable[[], int] | None = None

    def observe(self, drafted: int, draft_seconds: float, verified: int, verify_seconds: float, wire_seconds: float,
                ask_seconds: float | None = None) -> None:
        """One step: `wire_seconds` the target exchange's, `ask_seconds` the draft exchange's round
        trip (wall minus the draft's compute) when the step asked the draft, else None."""
        with self._lock:
            if not self._scaled:
                # The priors are in target-token units; the first timed step gives the unit in seconds.
                self._rescale(verify_seconds / self.prior.verify[verified - 1])
            if drafted:
                self._draft = [self._draft[0] * self.decay + draft_seconds, self._draft[1] * self.decay + drafted]
            if ask_seconds is not None:
                self._ask = [self._ask[0] * self.decay + ask_seconds, self._ask[1] * self.decay + 1]
            cell = self._verify[min(verified, MAX_VERIFY_POSITIONS) - 1]
            cell[0], cell[1] = cell[0] * self.decay + verify_seconds, cell[1] * self.decay + 1
            self._wire = [self._wire[0] * self.decay + wire_seconds, self._wire[1] * self.decay + 1]

    def _rescale(self, unit: float) -> None:
        for cell in (self._draft, self._wire, self._ask, *self._verify):
            cell[0] *= unit
        self._scaled = True

    def costs(self) -> Costs:
        with self._lock:
            verify = monotone([seconds / count for seconds, count in self._verify], [count for _, count in self._verify])
            return Costs(self._draft[0] / self._draft[1], tuple(verify), self._wire[0] / self._wire[1], self._ask[0] / self._ask[1])


def best_prefix(confidence: list[float], costs: Costs) -> int:
    """The prefix length g of a proposal (0..len) with the most expected tokens per second, where
    confidence[k - 1] is the probability that its first k tokens are all accepted."""
    best, best_rate, expected = 0, 1.0 / costs.step_seconds(0), 1.0
    for g, p in enumerate(confidence[: MAX_VERIFY_POSITIONS - 1], start=1):
        expected += p
        rate = expected / costs.step_seconds(g)
        if rate > best_rate:
            best, best_rate = g, rate
    return best


def best_length(acceptance: float, costs: Costs, max_length: int) -> int:
    """The draft length in [0, max_length] with the most expected tokens per second (0: don't draft)."""
    return max(range(0, max_length + 1), key=lambda g: expected_tokens(acceptance, g) / costs.step_seconds(g))
