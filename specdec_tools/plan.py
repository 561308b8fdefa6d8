"""The analytic model of speculative decoding: what a draft length should buy, before measuring it.

Leviathan et al. (2023): with per-token acceptance a, a step that drafts g tokens yields
    E(g) = (1 - a^(g+1)) / (1 - a)                         tokens (accepted drafts + the target's own)
and costs
    T(g) = g * c * V(1) + V(g + 1) + hops * RTT             seconds
where c is the draft's cost per token relative to one target decoding step V(1), V(n) the target's
forward over n new positions, and hops the network round trips per step (2 over gRPC: draft and
target, 1 when not drafting; 0 in one process). The target alone makes one token per V(1), so the speed-up is
    S(g) = E(g) * V(1) / T(g).

Real runs do not draft exactly g every step: an n-gram drafter finds no match, the adaptive policy
skips drafting. `predict_mix` takes that into account (a fraction f of the steps drafts a mean of g
tokens, the rest decode one token), which is what `specdec bench` compares its measurements with.
`specdec plan` prints the table for every g and names the best one.
"""

from __future__ import annotations

import dataclasses
import statistics

from specdec.maths.costs import CostCurve, expected_tokens


@dataclasses.dataclass(frozen=True)
class Prediction:
    draft_length: float
    tokens_per_step: float
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


def median_curve(curves: list[CostCurve]) -> CostCurve:
    """Point-wise median of curves measured at the same n (on a noisy machine, one curve per pass)."""
    ns = [n for n, _ in curves[0].points]
    return CostCurve(tuple((n, statistics.median(c(n) for c in curves)) for n in ns))


def expected_tokens_fractional(acceptance: float, gamma: float) -> float:
    """E(g) for a mean draft length g that need not be whole (the closed form holds for real g)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1.0 - acceptance ** (gamma + 1.0)) / (1.0 - acceptance)


def predict(acceptance: float, draft_cost: float, curve: CostCurve, gamma: int, rtt: float = 0.0, hops: int = 0) -> Prediction:
    """One draft length, every step drafting `gamma` tokens; draft_cost c is relative to V(1)."""
    trips = hops if gamma > 0 else min(hops, 1)  # no draft call when not drafting
    step = gamma * draft_cost * curve.single + curve(gamma + 1) + trips * rtt
    return Prediction(gamma, expected_tokens(acceptance, gamma), step)


def predict_mix(acceptance: float, draft_cost: float, curve: CostCurve, mean_draft: float, drafting_share: float,
                rtt: float = 0.0, hops: int = 0) -> Prediction:
    """A run where `drafting_share` of the steps draft `mean_draft` tokens on average, the rest none."""
    f = min(max(drafting_share, 0.0), 1.0)
    if mean_draft <= 0:
        f = 0.0
    tokens = f * expected_tokens_fractional(acceptance, mean_draft) + (1 - f)
    step = (f * (mean_draft * draft_cost * curve.single + curve(mean_draft + 1) + hops * rtt)
            + (1 - f) * (curve(1) + min(hops, 1) * rtt))
    return Prediction(mean_draft, tokens, step)


@dataclasses.dataclass(frozen=True)
class OverlapPrediction:
    hit_rate: float  # steps whose run-ahead becomes the next draft
    sequential_step: float  # seconds per step, drafting then verifying
    overlapped_step: float  # seconds per step with the draft running ahead

    @property
    def speedup(self) -> float:
        """Overlapped over sequential tokens/s: both schedules verify the same drafts, so they
        make the same tokens per step and only the step time differs."""
        return self.sequential_step / self.overlapped_step


def predict_overlap(acceptance: float, gamma: int, draft_token_s: float, verify_s: float, wire_s: float = 0.0,
                    catch_up_s: float = 0.0) -> OverlapPrediction:
    """Overlapped speculation (coordinator/policy/overlap.py) against the sequential schedule, with the
    draft and the target on separate hardware.

    A run-ahead is used when the target accepts all g draft tokens (a^g) and its bonus token is
    the one the draft guessed (about one more acceptance: a), so h = a^(g+1). A sequential step
    drafts (`catch_up_s` to feed the target's last tokens, then `draft_token_s` per token), then
    verifies; a step whose draft is ready costs the longer of its Verify and the run-ahead beside
    it: g+1 tokens continuing the draft's own chain, with nothing to catch up on. Any other step
    is a sequential one, after a lost bet also waiting for the cancelled run-ahead to finish the
    forward it is in (half a draft token on average). `wire_s`: the round trips of a sequential
    step (a Propose and a Verify); a ready step makes one of them.
    """
    h = acceptance ** (gamma + 1) if gamma > 0 else 0.0
    sequential = catch_up_s + gamma * draft_token_s + verify_s + wire_s
    ready = max(verify_s, (gamma + 1) * draft_token_s) + wire_s / 2
    fresh = sequential + 0.5 * draft_token_s
    return OverlapPrediction(h, sequential, h * ready + (1 - h) * fresh)


def fit_draft_costs(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(catch-up seconds, seconds per token) from (tokens drafted, seconds) per drafting step at
    several draft lengths: a least-squares line. One length cannot separate the two: all per token."""
    points = [(x, y) for x, y in points if x > 0]
    if not points:
        return 0.0, 0.0
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    intercept = my - slope * mx
    if slope <= 0 or intercept < 0:  # noise: fall back to the plain per-token cost
        return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)
    return intercept, slope


def speedup(prediction: Prediction, curve: CostCurve) -> float:
    """Over the target alone, which makes one token per V(1) (and makes no round trips)."""
    return prediction.tokens_per_second * curve.single


def acceptance_from_steps(tokens_per_step: float, gamma: float) -> float:
    """Inverts E(g) = tokens_per_step for a: the per-token acceptance a run's verdicts imply.

    E is increasing in a on [0, 1], from 1 to g + 1, so bisection finds the one root.
    """
    if gamma <= 0:
        return 0.0
    target = min(max(tokens_per_step, 1.0), gamma + 1.0)
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens_fractional(mid, gamma) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def plan_table(acceptance: float, draft_cost: float, curve: CostCurve, max_length: int, rtt: float = 0.0,
               hops: int = 0) -> tuple[list[Prediction], int]:
    """Predictions for g = 0..max_length, and the g with the most tokens per second."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if draft_cost < 0 or max_length < 0 or rtt < 0 or hops < 0:
        raise ValueError("draft cost, max length, RTT and hops must be >= 0")
    rows = [predict(acceptance, draft_cost, curve, g, rtt, hops) for g in range(max_length + 1)]
    best = max(range(len(rows)), key=lambda g: rows[g].tokens_per_second)
    return rows, best


def format_plan(rows: list[Prediction], best: int, curve: CostCurve) -> str:
    lines = [f"{'g':>3} {'E tokens/step':>14} {'step ms':>9} {'tokens/s':>9} {'speed-up':>9}"]
    for g, row in enumerate(rows):
        mark = "  <- best" if g == best else ""
        lines.append(f"{g:>3} {row.tokens_per_step:>14.3f} {row.step_seconds * 1e3:>9.2f} {row.tokens_per_second:>9.2f} "
                     f"{speedup(row, curve):>8.2f}x{mark}")
    return "\n".join(lines)
