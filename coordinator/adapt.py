"""Adaptive draft length: how many tokens to draft next, and how confident the draft must stay.

Two levers, both per request:
1. A threshold on the draft's cumulative probability, sent with each Propose: the draft stops as
   soon as the product of its tokens' probabilities falls below it. It rises after a rejection
   (draft less boldly) and falls after a full accept (draft further).
2. A cap g on the draft length that maximises expected tokens per second (Leviathan et al.):
       E(g) = (1 - a^(g+1)) / (1 - a)                   tokens per step at per-token acceptance a
       T(g) = [g > 0] (t_ask + g * t_draft) + V(g + 1) + t_wire   seconds per step
   with a measured from this request's verdicts, t_ask (the draft exchange's round trip),
   t_draft (seconds per draft token), V(n) (target seconds for a forward over n new tokens, kept
   per n and fitted non-decreasing) and t_wire (the target exchange's) from the steps the
   coordinator has timed (shared across requests: they describe the machines). g = 0 (no drafting) wins when
   acceptance is too low to pay for a longer target forward; a probe step now and then keeps the
   acceptance estimate alive.

A draft whose cumulative probabilities are calibrated (the n-gram drafter's, draft_service/ngram.py)
gets a third lever on top: its proposal, up to the cap, is cut at the prefix with the most expected
tokens per second, E(g) = 1 + the sum of its first g cumulative probabilities. A 1-token match,
right ~20% of the time, is then not checked when checking costs more than it brings. The cap stays
per request: a calibration shared by all requests learns a request's text too slowly. When it asked
for the whole length every step, a chat prompt the target paraphrases got 95 tokens drafted and 5
accepted over gRPC (0.72x), and the cap would have skipped those Propose round trips.

Seeded requests use the static cost priors instead of measured times, so the same seed gives the
same draft lengths, hence the same random draws, hence the same tokens on every run.

Under load the coordinator caps g further by the number of running requests (CostModel.draft_cap,
coordinator/scheduler.py): a full batch has no compute to spare for positions that may be thrown away.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable


def expected_tokens(acceptance: float, gamma: int) -> float:
    """E(g): expected tokens per step (accepted drafts plus the target's own token)."""
    if acceptance >= 1.0:
        return float(gamma + 1)
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


MAX_VERIFY_POSITIONS = 33  # a proposal of up to 32 tokens plus the bonus position


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


# Priors in units of one target token (DESIGN.md §4, 2-core CPU): a model draft costs ~0.1 of it,
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
        # coordinator's scheduler: coordinator/scheduler.py); None: no load cap.
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


@dataclasses.dataclass
class DraftLengthPolicy:
    """One request's adaptive state. `plan()` before a step, `observe()` after it."""

    max_length: int
    cost_model: CostModel | None = None  # None: use static priors (seeded requests)
    prior: Costs = MODEL_DRAFT_PRIOR
    adaptive: bool = True
    calibrated: bool = False  # the draft's cumulative probabilities are calibrated: also cut each proposal (cut())
    threshold: float = 0.05  # draft's cumulative probability below which it stops drafting
    threshold_up: float = 1.5  # multiplied in after a rejection...
    threshold_down: float = 0.7  # ...and after a full accept
    threshold_bounds: tuple[float, float] = (0.005, 0.6)
    # Acceptance counts, decayed so that the estimate follows the text as it changes.
    accepted_weight: float = 2.0  # prior: a = 2 / (2 + 1) ~ 0.67
    rejected_weight: float = 1.0
    decay: float = 0.9
    min_probe_every: int = 8  # when not drafting pays, still draft every this many steps...
    max_probe_every: int = 32  # ...backing off to this while probes find nothing
    probe_every: int = 8
    idle_steps: int = 0
    probing: bool = False
    # A calibrated draft's asks that left nothing to verify, in a row, and the steps still to wait
    # before the next ask (asked()).
    empty_asks: int = 0
    rest: int = 0
    max_rest: int = 8
    idle: bool = False  # the last plan() chose not to draft at the acceptance seen (not a rest, not a probe)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance a: accepted trials over all trials (each step ends in <= 1 rejection)."""
        return self.accepted_weight / (self.accepted_weight + self.rejected_weight)

    def plan(self) -> tuple[int, float]:
        """(max draft tokens, min cumulative probability) for the next step."""
        if not self.adaptive or self.max_length == 0:
            return self.max_length, 0.0
        self.idle = False
        if self.rest:
            self.rest -= 1
            return 0, self.threshold
        max_length = self.max_length
        if self.cost_model is not None and self.cost_model.draft_cap is not None:
            max_length = min(max_length, self.cost_model.draft_cap())  # speculation shrinks as the batch fills
        costs = self.cost_model.costs() if self.cost_model is not None else self.prior
        gamma = best_length(self.acceptance, costs, max_length)
        self.probing = False
        if gamma == 0:
            # Not drafting is best at the acceptance seen so far; draft once in a while anyway, or
            # the estimate could never recover when the text turns predictable. Probes that find
            # nothing come ever more rarely (up to every 8 * 4 steps).
            self.idle_steps += 1
            if self.idle_steps % self.probe_every:
                self.idle = True
                return 0, self.threshold
            self.probing = True
            gamma = min(max_length, 4)
        else:
            self.probe_every = self.min_probe_every
        return gamma, self.threshold

    def quiet_steps(self) -> int | None:
        """Steps after the one just planned that will not draft (None: no step will, speculation is
        off). The coordinator lets the target decode those in the same exchange (decode_ahead):
        a rest after empty asks, or the idle steps before the next probe. The idle count assumes
        the acceptance stays where it is, which only a drafting step could change."""
        if self.max_length == 0:
            return None
        if not self.adaptive:
            return 0
        if self.rest:
            return self.rest
        if self.idle:
            return self.probe_every - 1 - self.idle_steps % self.probe_every
        return 0

    def skip(self, steps: int) -> None:
        """`steps` steps passed without drafting, inside quiet_steps(): as if plan() had run for each."""
        for _ in range(steps):
            if self.rest:
                self.rest -= 1
            elif self.idle:
                self.idle_steps += 1

    def cut(self, confidence: list[float] | None) -> int | None:
        """How many tokens of a calibrated draft's proposal to verify (None: keep them all)."""
        if not (self.calibrated and self.adaptive and confidence):
            return None
        return best_prefix(confidence, self.cost_model.costs() if self.cost_model is not None else self.prior)

    def asked(self, kept: int) -> None:
        """A calibrated draft was asked for a proposal and `kept` of its tokens survived cut().

        An ask that leaves nothing (no match at all, or one too weak to check) still costs a round
        trip to a draft service: ~1.4 ms on 2 CPU cores, 3% of a step. On chat prompts the n-gram
        drafter was asked nearly every step and came back empty on most, because an empty proposal
        teaches the acceptance estimate nothing. Empty asks come in runs (new words), so after one
        the next ask waits 1, 2, 4, then up to 8 steps, until an ask finds something to verify. A
        replay of the target's greedy outputs had this at +2% (chat) and +3% (grounded) with
        1.4 ms asks, and no loss with free ones (in process)."""
        if not (self.calibrated and self.adaptive):
            return
        if kept:
            self.empty_asks = 0
            return
        self.empty_asks += 1
        self.rest = min(self.max_rest, 2 ** (self.empty_asks - 1))

    def nothing_drafted(self) -> None:
        """The draft was asked for tokens and sent none: its own first token already fell under the
        threshold. Rejections only ever raise the threshold, so without this a draft whose
        probabilities run low (a draft trained on soft labels) is shut out for good once it reaches
        the upper bound: no draft, no observation, no way back down."""
        self.threshold = max(self.threshold_bounds[0], self.threshold * self.threshold_down)

    def observe(self, drafted: int, accepted: int) -> None:
        if self.probing and accepted == 0:
            self.probe_every = min(self.max_probe_every, self.probe_every * 2)
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
