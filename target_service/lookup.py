"""Prompt lookup in the target, and what a drafted position costs a pass (no gRPC here).

On passes that have no draft of their own the target drafts for itself by prompt lookup over the
sequence's own tokens (VerifyCall.lookup_draft_length; specdec/maths/lookup.py does the matching). A
draft is cut where its next token is not worth what it adds to the pass: by the caller's V(n) / V(1),
or where several rows share the pass by what a position adds to it (PassCosts), whichever costs more.
Apart from the engine's verify path because it is a policy over the verify path, not part of it:
TargetEngine (engine.py) takes TargetLookup's methods in, decoding ahead (decode_ahead.py) and prefill
planning (prefill.py) call them.
"""

from __future__ import annotations

import dataclasses
import itertools

from specdec.kv.store import Sequence
from specdec.limits import MAX_DRAFT_TOKENS, MAX_VERIFY_POSITIONS
from specdec.maths.lookup import LOOKUP_MAX_N, NgramIndex, in_source, looked, lookup_draft, rests
from specdec.calls.request import VerifyCall, VerifyResult


class PassCosts:
    """Seconds of one forward against the positions it feeds, a + b * positions, fitted by least
    squares over recent forwards (each reading weighs `decay` times less per later one).

    Why: where a pass holds several rows, a drafted position costs what it adds to the pass
    (`b`), which the rows' share of the pass must pay back; a coordinator's V(n) / V(1), timed on
    its own requests' steps, cannot tell that cost apart, since the other rows set a batched pass's
    time. On a CPU a drafted position adds a sizeable part of a row's share of a batched pass (at
    8 rows on 2 cores, a first draft token had to be right ~40% of the time to pay:
    benchmarks/results/lookup-by-pass-costs/NOTES.md); on a GPU `b` is near 0 until compute binds.
    `lookup_costs(rows, most)` is V(1 + g) / V(1) as seen from one row's share, in the form
    VerifyCall.lookup_costs carries."""

    MIN_READINGS = 8.0  # no estimate before this many (decayed) readings, nor without spread
    # While the readings cannot say, one row's draft in this many is left to its caller's costs.
    # Why: the cautious default cuts every draft, and a steady load (so many rows, one position
    # each, pass after pass) then feeds forwards of one size only: the line would never have the
    # spread it needs and the cut would stay blind. A drafted row is verified like any other, so
    # this costs at most a few positions, never a token's correctness.
    EXPLORE_EVERY = 16

    # Decayed readings a size of lone pass needs before its own mean replaces the caller's figure.
    MIN_LONE = 3.0

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._sums = [0.0] * 5  # weight, x, y, xx, xy
        self._asked = 0  # lookup_costs calls while the line was unknown
        # One row's passes, by positions: [decayed weight, decayed seconds] per size (index = positions).
        self._lone = [[0.0, 0.0] for _ in range(MAX_VERIFY_POSITIONS + 1)]

    def observe(self, positions: int, seconds: float) -> None:
        d, x, y = self.decay, float(positions), seconds
        w, sx, sy, sxx, sxy = self._sums
        self._sums = [w * d + 1, sx * d + x, sy * d + y, sxx * d + x * x, sxy * d + x * y]

    def observe_lone(self, positions: int, seconds: float) -> None:
        """A pass of one row over `positions` new positions took `seconds` (its lookup, forward and verdict)."""
        if 1 <= positions <= MAX_VERIFY_POSITIONS:
            cell = self._lone[positions]
            cell[0], cell[1] = cell[0] * self.decay + 1, cell[1] * self.decay + seconds

    def lone_costs(self, caller: tuple[float, ...]) -> tuple[float, ...]:
        """V(1 + g) / V(1) for a lone row's lookup draft: the caller's figures, each size this engine
        has timed often enough replaced by its own mean, then made non-decreasing.

        Why: a caller that sees a request only as bursts decoded ahead (answered whole, or streamed by
        a drafted run) never times a step, so it hands on its priors; on a CPU with an fp32 target
        those put 4 positions at 1.3 passes where they cost ~1.5, and a 1-token match (right one time
        in ten on arithmetic) was drafted 3 long, each such pass slower than no draft. Sizes the cut
        picks get timed, so a size the prior makes too cheap is corrected by its own use."""
        lone = self._lone
        if not caller or lone[1][0] < self.MIN_LONE:
            return caller
        single = lone[1][1] / lone[1][0]
        own = [seconds / weight / single if weight >= self.MIN_LONE else cost
               for cost, (weight, seconds) in zip(caller, lone[1:])]
        own[0] = 1.0
        return tuple(itertools.accumulate(own, max))

    def line(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds a position, or None while the readings cannot say."""
        w, sx, sy, sxx, sxy = self._sums
        if w < self.MIN_READINGS:
            return None
        var = sxx / w - (sx / w) ** 2
        if var < 1.0:  # all forwards fed (nearly) as many positions: no slope to read
            return None
        b = max(0.0, (sxy / w - sx / w * sy / w) / var)
        a = sy / w - b * sx / w
        return (a, b) if a > 0 else None

    def lookup_costs(self, rows: int, most: int) -> tuple[float, ...]:
        """Relative costs of 1..most+1 positions for one of `rows` rows (() for one row: its
        caller's costs hold). Before the readings say, a position costs a whole share (nothing
        drafted pays): a full batch on a CPU comes near that, and the first passes measure it;
        every EXPLORE_EVERY-th ask meanwhile gets () so that some passes do carry drafts."""
        if rows < 2:
            return ()
        line = self.line()
        if line is None:
            self._asked += 1
            if self._asked % self.EXPLORE_EVERY == 0:
                return ()
            return tuple(1.0 + g for g in range(most + 1))
        a, b = line
        share = (a + b * rows) / rows
        return tuple(1.0 + g * b / share for g in range(most + 1))


class TargetLookup:
    """The target's own lookup drafts, as methods of TargetEngine: each reads the engine's `lm`
    (its context bound), `calibration` (MatchCalibration: the chance each token of a match is
    right) and `pass_costs` (PassCosts)."""

    @staticmethod
    def _lookup_index(call: VerifyCall, seq: Sequence) -> NgramIndex:
        """The sequence's prompt-lookup index, kept beside its cache across calls (Sequence.side).

        The index keeps the tokens it shares with the sequence and indexes only the rest: a step
        indexes the tokens that arrived since the last one, not the whole sequence, and a call's
        passes decoded ahead reuse what its own pass indexed. Shared, not merely held by both: a
        call without lookup may have rolled the sequence back and re-grown it in between (then the
        tokens below call.known_len are still shared), and a stale n-gram would draft worse tokens,
        never wrong ones. A call that brings a source (a predicted output: the call that creates the
        sequence, or re-fills it) starts an index over it, which later calls keep."""
        index = seq.side if isinstance(seq.side, NgramIndex) else None
        if index is None or (call.lookup_source and tuple(call.lookup_source) != index.source):
            index = NgramIndex(LOOKUP_MAX_N, 1, call.lookup_source)
        keep = min(len(index), len(seq.tokens))
        if index.tokens[:keep] != seq.tokens[:keep]:
            keep = min(keep, call.known_len)
            if index.tokens[:keep] != seq.tokens[:keep]:
                index, keep = NgramIndex(LOOKUP_MAX_N, 1, index.source), 0
        index.crop(keep - len(index))
        seq.side = index
        return index

    def _lookup_costs(self, call: VerifyCall, rows: int, known: dict | None = None) -> tuple[float, ...]:
        """The relative costs that cut a row's lookup draft: the caller's V(n) / V(1) (its own
        requests' steps) with the sizes this engine has timed for a lone row in its own passes
        (PassCosts.lone_costs), or where `rows` rows share the pass and it costs more, what each
        drafted position adds to the pass against the row's share of it (PassCosts). None asked
        (a fixed draft length): none given. `known`: the costs worked out for the other rows of
        the same pass, by caller's figures (rows whose callers share them share the answer)."""
        mine = call.lookup_costs
        if not mine:
            return mine
        if known is not None and mine in known:
            return known[mine]
        if rows < 2:
            out = self.pass_costs.lone_costs(mine)
        else:
            pass_costs = self.pass_costs.lookup_costs(rows, len(mine) - 1)
            out = tuple(max(c, s) for c, s in zip(mine, pass_costs)) if pass_costs else mine
        if known is not None:
            known[mine] = out
        return out

    def _with_lookup(self, call: VerifyCall, seq: Sequence, rows: int = 1, known: dict | None = None) -> VerifyCall:
        """`call` with the draft prompt lookup makes for its pass (maybe none), among `rows` rows: none
        without looking while the sequence's lookups rest (_looks; a call that brings a source looks)."""
        kept = seq.side if isinstance(seq.side, NgramIndex) else None
        if kept is not None and not call.lookup_source and rows > 1 and rests(kept):
            return call
        index = self._lookup_index(call, seq)
        index.extend(seq.tokens[len(index):], indexed=self._indexed(index, rows))
        room = MAX_DRAFT_TOKENS
        if self.lm.max_context:
            room = min(room, self.lm.max_context - len(seq.tokens))
        draft, proposal, n = lookup_draft(index, self.calibration, call.lookup_draft_length, self._lookup_costs(call, rows, known), room)
        if rows > 1:
            looked(index, len(draft))
        return dataclasses.replace(call, draft_tokens=draft, draft_dists=[], lookup_match=(n, tuple(proposal))) if n else call

    @staticmethod
    def _indexed(index: NgramIndex, rows: int) -> int | None:
        """How many of the tokens a lookup catches up on get indexed: after a rest only the last
        few (NgramIndex.extend), so that resting saves the indexing too; all of them otherwise."""
        return LOOKUP_MAX_N if rows > 1 and index.empties else None

    def _looks(self, index: NgramIndex, tokens: list[int], rows: int) -> bool:
        """Whether a pass decoding ahead looks up the row's draft; if so, the index has caught up on `tokens`.
        Where `rows` rows share the pass, a sequence whose lookups drafted nothing rests them
        (specdec/maths/lookup.py, `rests`): a lone row's lookup costs little beside its pass."""
        if rows > 1 and rests(index):
            return False
        index.extend(tokens[len(index):], indexed=self._indexed(index, rows))
        return True

    def _as_decoded(self, call: VerifyCall, result: VerifyResult, seq: Sequence) -> VerifyResult:
        """A result whose draft was the target's own, as the caller sees it: the caller knows no
        draft tokens, so the accepted ones come first among the tokens made canonical (next_token,
        then decoded), and count with the lookup drafts of the passes decoded ahead."""
        n, proposal = call.lookup_match
        odds = seq.side.odds if isinstance(seq.side, NgramIndex) else None
        self.calibration.observe(n, list(proposal), [*call.draft_tokens[:result.accepted], result.next_token], odds)
        tokens = [*call.draft_tokens[:result.accepted], result.next_token, *result.decoded]
        predicted = (len(call.draft_tokens), result.accepted) if in_source(n) else (0, 0)
        return dataclasses.replace(result, accepted=0, next_token=tokens[0], decoded=tuple(tokens[1:]),
                                   ahead_drafted=result.ahead_drafted + len(call.draft_tokens),
                                   ahead_accepted=result.ahead_accepted + result.accepted,
                                   predicted_drafted=result.predicted_drafted + predicted[0],
                                   predicted_accepted=result.predicted_accepted + predicted[1])
