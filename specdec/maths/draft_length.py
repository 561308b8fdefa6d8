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
   acceptance estimate alive. A request starts from the acceptance recent requests saw
(AcceptanceMemory), not from a fixed guess.

A draft whose cumulative probabilities are calibrated (the n-gram drafter's, draft_service/drafters/ngram.py)
gets a third lever on top: its proposal, up to the cap, is cut at the prefix with the most expected
tokens per second, E(g) = 1 + the sum of its first g cumulative probabilities. A 1-token match,
right ~20% of the time, is then not checked when checking costs more than it brings. The cap stays
per request: a calibration shared by all requests learns a request's text too slowly. When it asked
for the whole length every step, a chat prompt the target paraphrases got many tokens drafted and
few accepted over gRPC, slower than no speculation, and the cap would have skipped those Propose
round trips.

Seeded requests use the static cost priors instead of measured times, so the same seed gives the
same draft lengths, hence the same random draws, hence the same tokens on every run.

Under load the coordinator caps g further by the number of running requests (CostModel.draft_cap,
coordinator/policy/admission.py): a full batch has no compute to spare for positions that may be thrown away.
"""

from __future__ import annotations

import dataclasses
import threading

from specdec.maths.costs import MODEL_DRAFT_PRIOR, CostModel, Costs, best_length, best_prefix


# Drafted steps' worth of trials the shared acceptance needs before a new request starts from it.
MEMORY_MIN_TRIALS = 8.0
# Draft tokens a probe asks for: enough to see whether drafting pays again (a probe is a bet at an
# acceptance that did not pay: each token costs a draft forward and a verified position).
PROBE_LENGTH = 2


class AcceptanceMemory:
    """Per-token acceptance over the recent steps of all requests, for a new request's first steps.

    Why: each request began at the fixed prior (a = 2/3) and drafted at the lengths that acceptance
    pays for until its own verdicts pulled the estimate down. With a draft accepting a quarter of
    its tokens, a short answer spent most of its steps that way, and speculation cost more than it
    gave. The draft and target are the same for every request of a coordinator (and for every run
    of a target), so the acceptance the last requests saw is the better first guess; each request
    still moves from it with its own verdicts, at the weight the fixed prior had.

    A memory that says "do not draft" would never hear otherwise if short requests, which never
    reach a probe, were all that came: so each request started from it ages it (`request_decay`),
    and once too little is left the next request starts from the fixed prior again and drafts,
    which refreshes it. Thread-safe: the coordinator's tools may run loops on other threads."""

    def __init__(self, decay: float = 0.99, weight: float = 3.0, request_decay: float = 0.9):
        self.decay, self.weight, self.request_decay = decay, weight, request_decay
        self._accepted = self._trials = 0.0
        self._lock = threading.Lock()

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        with self._lock:
            self._accepted = self._accepted * self.decay + accepted
            self._trials = self._trials * self.decay + trials

    @property
    def acceptance(self) -> float | None:
        """The shared estimate, or None until enough steps were seen (or after too long unheard)."""
        with self._lock:
            return self._accepted / self._trials if self._trials >= MEMORY_MIN_TRIALS else None

    def prior(self) -> tuple[float, float] | None:
        """(accepted, rejected) weights a new request starts from, or None (keep the fixed prior).
        Each call is a request starting: it ages what the memory holds."""
        with self._lock:
            if self._trials < MEMORY_MIN_TRIALS:
                return None
            a = self._accepted / self._trials
            self._accepted *= self.request_decay
            self._trials *= self.request_decay
        return self.weight * a, self.weight * (1.0 - a)


@dataclasses.dataclass
class DraftLengthPolicy:
    """One request's adaptive state. `plan()` before a step, `observe()` after it."""

    draft_length: int  # the request's: the most a step drafts (0: speculation off)
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
    capped: bool = False  # the last plan()'s draft length was 0 because the load cap left no room (draft_cap)
    # Acceptance shared with the other requests: where this one starts, and what it adds to.
    # None for seeded requests, whose lengths must not depend on what ran before them.
    memory: AcceptanceMemory | None = None

    def __post_init__(self):
        shared = self.memory.prior() if self.memory is not None and self.adaptive else None
        if shared is not None:
            self.accepted_weight, self.rejected_weight = shared

    @property
    def acceptance(self) -> float:
        """Per-token acceptance a: accepted trials over all trials (each step ends in <= 1 rejection)."""
        return self.accepted_weight / (self.accepted_weight + self.rejected_weight)

    def plan(self) -> tuple[int, float]:
        """(draft length, min cumulative probability) for the next step.

        Called for every step of every running request on the coordinator's one event loop, and
        a batched target pass waits for all of them: a step that will not draft must cost what a
        step without speculation costs. So the costs are weighed only where the answer can change.
        A full batch (the load cap at 0) leaves nothing to weigh; the cap is read again every step,
        so drafting resumes as soon as the batch thins. Between probes the acceptance cannot change
        (only a drafted step updates it), and the probe that ends the stretch weighs the costs
        afresh: the same schedule as the steps a target decodes ahead (skip()), which are never
        planned at all. Weighing every step cost the idle requests of a full batch more coordinator
        time than the speculation it turned off saved.
        """
        self.capped = False
        self.probing = False  # only the step a probe drafts may back the probes off (observe())
        if not self.adaptive or self.draft_length == 0:
            return self.draft_length, 0.0
        if self.rest:
            self.rest -= 1
            self.idle = False
            return 0, self.threshold
        cap = self.draft_length
        if self.cost_model is not None and self.cost_model.draft_cap is not None:
            cap = min(cap, self.cost_model.draft_cap())  # speculation shrinks as the batch fills
        if cap == 0:
            # Speculation off by load (said in the response statistics and metrics). Not a probe
            # either: one could not draft, and an empty probe would back the real ones off.
            self.capped, self.idle = True, False
            return 0, self.threshold
        if self.idle and (self.idle_steps + 1) % self.probe_every:
            self.idle_steps += 1  # within the stretch between probes
            return 0, self.threshold
        self.idle = False
        costs = self.cost_model.costs() if self.cost_model is not None else self.prior
        draft_length = best_length(self.acceptance, costs, cap)
        if draft_length == 0:
            # Not drafting is best at the acceptance seen so far; draft once in a while anyway, or
            # the estimate could never recover when the text turns predictable. Probes that find
            # nothing come ever more rarely (up to every 8 * 4 steps).
            self.idle_steps += 1
            if self.idle_steps % self.probe_every:
                self.idle = True
                return 0, self.threshold
            self.probing = True
            draft_length = min(cap, PROBE_LENGTH)
        else:
            self.probe_every = self.min_probe_every
        return draft_length, self.threshold

    def quiet_steps(self) -> int | None:
        """Steps after the one just planned that will not draft (None: as many as the coordinator
        allows). The coordinator lets the target decode those in the same exchange (decode_ahead):
        a rest after empty asks, or the idle steps before the next probe. None when speculation is
        off, and when the load cap left no room: such a step is a step without speculation, and a
        target decodes ahead only for a sequence running alone, which the cap no longer holds back.
        The idle count assumes the acceptance stays where it is, which only a drafting step could change."""
        if self.draft_length == 0:
            return None
        if not self.adaptive:
            return 0
        if self.rest:
            return self.rest
        if self.capped:
            return None
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
        trip to a draft service, a few percent of a step on CPUs. On chat prompts the n-gram
        drafter was asked nearly every step and came back empty on most, because an empty proposal
        teaches the acceptance estimate nothing. Empty asks come in runs (new words), so after one
        the next ask waits 1, 2, 4, then up to 8 steps, until an ask finds something to verify. A
        replay of the target's greedy outputs gained with costly asks (over gRPC) and lost nothing
        with free ones (in process)."""
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
        if self.memory is not None:
            self.memory.observe(drafted, accepted)
        rejected = 1 if accepted < drafted else 0
        self.accepted_weight = self.accepted_weight * self.decay + accepted
        self.rejected_weight = self.rejected_weight * self.decay + rejected
        low, high = self.threshold_bounds
        if rejected:
            self.threshold = min(high, self.threshold * self.threshold_up)
        else:
            self.threshold = max(low, self.threshold * self.threshold_down)
