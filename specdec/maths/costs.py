"""The cost model of a speculative step: expected tokens E(g), step seconds T(g), and the draft
length or proposal prefix that maximises tokens per second. Pure functions over measured costs,
plus CostModel, the running estimate of those costs that every request's steps feed.

       E(g) = (1 - a^(g+1)) / (1 - a)                   tokens per step at per-token acceptance a
       T(g) = [g > 0] (t_ask + g * t_draft) + V(g + 1) + t_wire   seconds per step
(Leviathan et al.), with t_ask the draft exchange's round trip, t_draft seconds per draft token,
V(n) target seconds for a forward over n new tokens (kept per n and fitted non-decreasing) and
t_wire the target exchange's. For a draft whose cumulative probabilities are calibrated (the n-gram
drafter's), E(g) = 1 + the sum of its first g cumulative probabilities (best_prefix).

How a request uses them (the threshold, probes, rests): specdec/maths/draft_length.py.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
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
    own pace: a policy that only ever drafted 5 tokens measured V(6) below V(2..5), which still
    held the prior's values, so 5 looked cheaper than 1..4 and stayed the only length tried."""
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

    Each quantity is a decayed mean of its readings, pulled towards the prior at weight
    `prior_weight`; V(n) is kept per n, since its shape (the 1 -> 2 jump on CPUs) is what decides
    whether drafting pays at all. The priors are in units of one target token, so they are read in
    seconds at the current `unit`: the scale that best fits the recent V(n) readings to the
    prior's shape. Every reading of V ages with every step observed, not only with its own cell's.

    Why both: a fresh coordinator whose first requests came as a burst of 10 streams drafted
    nothing for minutes after. Its first timed steps were batched, so V(1) came out several times
    a single stream's, and that one reading fixed the seconds of every prior for good: V(n > 1)
    stayed at the prior times the burst's V(1) until a draft of that length was measured, and
    next to the V(1) of single streams, drafting never paid, so none ever was. Readings kept per
    cell until their own cell is observed again have the same flaw for V(n) measured in a burst
    (--verify-token-budget 0). Aged, they give way to the prior's shape at today's scale, which is
    what lets the policy try drafting, and measure it, again.
    """

    def __init__(self, prior: Costs, decay: float = 0.97, prior_weight: float = 2.0):
        self.prior = prior
        self.decay = decay
        self.prior_weight = prior_weight
        self._lock = threading.Lock()
        # Readings only, each [decayed seconds, decayed weight]; the priors join them in costs().
        self._draft = [0.0, 0.0]  # per draft token
        self._wire = [0.0, 0.0]  # per target exchange
        self._ask = [0.0, 0.0]  # per draft exchange
        self._verify = [[0.0, 0.0] for _ in prior.verify]  # per n new positions
        # costs() of the readings so far: a step asks for them more than once (its draft length,
        # then its proposal's cut) and each answer fits the whole V(n) curve again.
        self._costs: Costs | None = None
        # Most draft tokens a request may verify per step under the current load (set by the
        # coordinator's scheduler: coordinator/policy/admission.py); None: no load cap.
        self.draft_cap: Callable[[], int] | None = None

    def observe(self, drafted: int, draft_seconds: float, verified: int, verify_seconds: float, wire_seconds: float,
                ask_seconds: float | None = None) -> None:
        """One step: `wire_seconds` the target exchange's, `ask_seconds` the draft exchange's round
        trip (wall minus the draft's compute) when the step asked the draft, else None."""
        d = self.decay
        with self._lock:
            if drafted:
                self._draft = [self._draft[0] * d + draft_seconds, self._draft[1] * d + drafted]
            if ask_seconds is not None:
                self._ask = [self._ask[0] * d + ask_seconds, self._ask[1] * d + 1]
            for cell in self._verify:
                cell[0], cell[1] = cell[0] * d, cell[1] * d
            cell = self._verify[min(verified, MAX_VERIFY_POSITIONS) - 1]
            cell[0], cell[1] = cell[0] + verify_seconds, cell[1] + 1
            self._wire = [self._wire[0] * d + wire_seconds, self._wire[1] * d + 1]
            self._costs = None

    def _unit(self) -> float:
        """Seconds per prior unit: the weighted fit of the V readings to the prior's shape (1 before any)."""
        seconds = sum(cell[0] for cell in self._verify)
        units = sum(cell[1] * v for cell, v in zip(self._verify, self.prior.verify))
        return seconds / units if units > 0 and seconds > 0 else 1.0

    def costs(self) -> Costs:
        with self._lock:
            if self._costs is None:
                self._costs = self._fit()
            return self._costs

    def _fit(self) -> Costs:
        """The readings joined with the priors (under the lock)."""
        unit, w = self._unit(), self.prior_weight

        def mean(cell: list[float], prior: float) -> float:
            return (cell[0] + prior * unit * w) / (cell[1] + w)

        verify = monotone([mean(cell, v) for cell, v in zip(self._verify, self.prior.verify)],
                          [cell[1] + w for cell in self._verify])
        return Costs(mean(self._draft, self.prior.draft_per_token), tuple(verify),
                     mean(self._wire, self.prior.wire_per_step), mean(self._ask, self.prior.draft_per_ask))


def knee(costs: Costs, factor: float = 1.5, most: int = 256) -> int:
    """The most positions one target pass may verify before it costs `factor` times a one-position
    pass: the verify-token budget the running requests share when none is configured. At 1.5 the
    CPU prior's curve gives 8, the budget 8 streams measured best with on 2 cores
    (coordinator/policy/admission.py); a GPU's flat curve gives `most`.

    Below the knee a pass is bound by reading the weights, and more positions (other requests' or
    drafted ones) ride along nearly free; past it they are paid for one by one. Measured V(n) where
    the model has it (n <= len(costs.verify)), then the line through the curve's last half, which on
    a GPU is nearly flat (the knee lies far beyond one request's proposal) and on a CPU steep.
    """
    v, limit = costs.verify, factor * costs.verify[0]
    inside = [n for n in range(1, len(v) + 1) if v[n - 1] <= limit]
    n = inside[-1] if inside else 1
    if n < len(v):
        return n
    half = len(v) // 2
    slope = (v[-1] - v[half - 1]) / (len(v) - half)
    if slope <= 0:
        return most
    return max(1, min(most, len(v) + int((limit - v[-1]) / slope)))


def knee_of_passes(seconds: dict[int, float], factor: float = 1.5, most: int = 256) -> int:
    """`knee` of passes timed at a few sizes ({positions: seconds}, 1 among them): the curve between
    them drawn straight (CostCurve), then knee's rule (past the largest size, the line through its last half).

    Why sizes, not every n: a target sizes the budget at start-up from a handful of timed passes
    (TargetEngine.pass_knee), on the device it serves from, rather than from a constant measured
    on one 2-core CPU."""
    curve = CostCurve(tuple(sorted(seconds.items())))
    return knee(Costs(0.0, tuple(curve(n) for n in range(1, curve.points[-1][0] + 1)), 0.0), factor, most)


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """V(n): seconds of one target forward over n new positions (n measured at a few points).

    Interpolated linearly between measured points (fractional n: mean draft lengths), extended by
    the last slope past the largest one.
    """

    points: tuple[tuple[int, float], ...]  # (n, seconds), n ascending

    def __post_init__(self):
        if not self.points or self.points[0][0] != 1:
            raise ValueError("a cost curve needs V(1): the target's one-token decoding step")
        if any(b[0] <= a[0] for a, b in zip(self.points, self.points[1:])):
            raise ValueError("cost curve points must have strictly increasing n")
        if any(s <= 0 or not math.isfinite(s) for _, s in self.points):
            raise ValueError("cost curve seconds must be positive and finite")

    @classmethod
    def parse(cls, text: str, unit: float = 1e-3) -> CostCurve:
        """'1:44,2:70,4:67,8:70' (milliseconds by default) -> CostCurve."""
        try:
            pairs = sorted((int(n), float(v) * unit) for n, v in (item.split(":") for item in text.split(",") if item.strip()))
        except ValueError as e:
            raise ValueError(f"cost curve {text!r}: expected n:ms pairs such as 1:44,2:70,4:67 ({e})") from e
        return cls(tuple(pairs))

    def __call__(self, n: float) -> float:
        ns = [p[0] for p in self.points]
        if n <= ns[0]:
            return self.points[0][1]
        i = bisect.bisect_left(ns, n)
        if i < len(ns) and ns[i] == n:
            return self.points[i][1]
        if i == len(ns):  # past the last point: extend the last slope (or flat with one point)
            if len(ns) == 1:
                return self.points[0][1]
            (n0, v0), (n1, v1) = self.points[-2], self.points[-1]
        else:
            (n0, v0), (n1, v1) = self.points[i - 1], self.points[i]
        return v0 + (v1 - v0) * (n - n0) / (n1 - n0)

    @property
    def single(self) -> float:
        return self.points[0][1]


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
