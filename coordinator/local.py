"""In-process Proposer and Verifier over the engines: the speculative loop without any network.

Benchmarks use them to separate the cost of gRPC from the cost of the algorithm, and tests use them
to inject faults deterministically (a sequence evicted between two steps, say), and to fix what each
pass is reported to cost (`fixed_costs`): the loop's learned cost model then sees the same seconds on
every machine, so the draft lengths the adaptive policy chooses do not follow the machine's load.
"""

from __future__ import annotations

import dataclasses
import time

from coordinator.protocol import DraftOutcome, Progress
from draft_service.engine import DraftEngine
from specdec.maths.costs import Costs
from specdec.maths.tree import tree_depth
from specdec.calls.request import ProposeCall, VerifyCall, VerifyResult
from target_service.engine import TargetEngine


def _forward_seconds(costs: Costs, positions: int) -> float:
    """V(n) of `costs` for a forward over n new positions (a prefill past the table costs its last entry)."""
    return costs.verify[min(max(positions, 1), len(costs.verify)) - 1]


class LocalVerifier:
    def __init__(self, engine: TargetEngine, fixed_costs: Costs | None = None):
        """`fixed_costs`: report each Verify as costing a forward over its new positions, V(n), plus
        one V(1) per token decoded ahead, and its exchange `wire_per_step` on top, instead of the
        seconds it took (None: the measured ones, as in production)."""
        self.engine = engine
        self.fixed_costs = fixed_costs

    def _seconds(self, compute: float, wall: float, positions: int, passes: int = 0, drafted: int = 0) -> tuple[float, float]:
        """(compute, wall) seconds to report for a Verify over `positions` new positions that decoded
        ahead in `passes` more forwards, with `drafted` lookup tokens among them, given the measured ones."""
        costs = self.fixed_costs
        if costs is None:
            return compute, wall
        one = _forward_seconds(costs, 1)
        compute = _forward_seconds(costs, positions) + passes * one + drafted * (_forward_seconds(costs, 2) - one)
        return compute, compute + costs.wire_per_step

    async def verify(self, call: VerifyCall) -> VerifyResult:
        start = time.perf_counter()
        result = self.engine.verify_tree(call) if call.tree is not None else self.engine.verify(call)
        compute, wall = self._seconds(result.compute_seconds, time.perf_counter() - start, call.new_positions,
                                      result.ahead_passes, result.ahead_drafted)
        # the passes after the call's own, in the reported seconds (the measured ones, or their share of the fixed ones)
        ahead = compute * result.ahead_seconds / result.compute_seconds if result.compute_seconds else 0.0
        return dataclasses.replace(result, compute_seconds=compute, wall_seconds=wall, ahead_seconds=ahead)

    async def release(self, sequence_id: str) -> None:
        self.engine.release(sequence_id)


class LocalProposer:
    def __init__(self, engine: DraftEngine, fixed_costs: Costs | None = None):
        """`fixed_costs`: report each Propose as costing `draft_per_token` per draft position (a
        tree's per level), and its exchange `draft_per_ask` on top, instead of the seconds it took
        (None: the measured ones, as in production)."""
        self.engine = engine
        self.fixed_costs = fixed_costs

    def _seconds(self, compute: float, wall: float, positions: int) -> tuple[float, float]:
        """(compute, wall) seconds to report for a Propose that drafted `positions` positions, given the measured ones."""
        costs = self.fixed_costs
        if costs is None:
            return compute, wall
        compute = positions * costs.draft_per_token
        return compute, compute + costs.draft_per_ask

    async def propose(self, call: ProposeCall, progress: Progress | None = None) -> DraftOutcome:
        if call.tree is not None:
            return self._propose_tree(call)
        start = time.perf_counter()
        proposals = list(self.engine.propose(call))
        for p in proposals if progress is not None else ():
            progress.arrived(p.token)
        wall = time.perf_counter() - start
        compute, wall = self._seconds(wall, wall, len(proposals))
        return DraftOutcome([p.token for p in proposals], [p.dist for p in proposals], compute, wall,
                            confidence=[p.cumulative_prob for p in proposals])

    def _propose_tree(self, call: ProposeCall) -> DraftOutcome:
        start = time.perf_counter()
        drafted = self.engine.propose_tree(call)
        compute, wall = self._seconds(drafted.compute_seconds, time.perf_counter() - start, tree_depth(drafted.parents))
        return DraftOutcome(drafted.tokens, drafted.child_dists, compute, wall, parents=drafted.parents)

    async def release(self, sequence_id: str) -> None:
        self.engine.release(sequence_id)
