"""In-process Proposer and Verifier over the engines: the speculative loop without any network.

Benchmarks use them to separate the cost of gRPC from the cost of the algorithm, and tests use them
to inject faults deterministically (a sequence evicted between two steps, say).
"""

from __future__ import annotations

import time

from coordinator.loop import DraftOutcome, Dist, VerifyOutcome
from draft_service.engine import DraftEngine, DraftSettings
from specdec.sampling import SamplingConfig
from target_service.engine import TargetEngine


class LocalVerifier:
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    async def verify(self, sequence_id: str, known_len: int, append: list[int], draft_tokens: list[int],
                     draft_dists: list[Dist], sampling: SamplingConfig) -> VerifyOutcome:
        start = time.perf_counter()
        dists = [d if d is not None else ([], []) for d in draft_dists] if any(d is not None for d in draft_dists) else []
        result = self.engine.verify(sequence_id, known_len, append, draft_tokens, dists, sampling)
        return VerifyOutcome(result.accepted, result.next_token, result.compute_seconds, time.perf_counter() - start)

    async def release(self, sequence_id: str) -> None:
        self.engine.release(sequence_id)


class LocalProposer:
    def __init__(self, engine: DraftEngine):
        self.engine = engine

    async def propose(self, sequence_id: str, known_len: int, append: list[int], max_tokens: int,
                      min_cumulative_prob: float, temperature: float, seed: int) -> DraftOutcome:
        start = time.perf_counter()
        settings = DraftSettings(max_tokens, min_cumulative_prob, temperature, seed)
        proposals = list(self.engine.propose(sequence_id, known_len, append, settings))
        dists: list[Dist] = [(p.dist_ids, p.dist_probs) if p.dist_ids is not None else None for p in proposals]
        wall = time.perf_counter() - start
        return DraftOutcome([p.token for p in proposals], dists, wall, wall)

    async def release(self, sequence_id: str) -> None:
        self.engine.release(sequence_id)
