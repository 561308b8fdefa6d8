"""In-process Proposer and Verifier over the engines: the speculative loop without any network.

Benchmarks use them to separate the cost of gRPC from the cost of the algorithm, and tests use them
to inject faults deterministically (a sequence evicted between two steps, say).
"""

from __future__ import annotations

import time

from coordinator.loop import DraftOutcome, Dist, Progress, TreeSpec, VerifyOutcome
from draft_service.engine import DraftEngine, DraftSettings
from draft_service.tree import TreeSettings
from specdec.model.features import FeatureRows
from specdec.spec.sampling import SamplingConfig
from target_service.engine import DraftTree, TargetEngine, VerifyCall


class LocalVerifier:
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    async def verify(self, sequence_id: str, known_len: int, append: list[int], draft_tokens: list[int],
                     draft_dists: list[Dist], sampling: SamplingConfig, return_features: bool = False,
                     decode_ahead: int = 0, logprobs: int | None = None, eos_banned_until: int = 0) -> VerifyOutcome:
        start = time.perf_counter()
        dists = [d if d is not None else ([], []) for d in draft_dists] if any(d is not None for d in draft_dists) else []
        result = self.engine.verify(sequence_id, known_len, append, draft_tokens, dists, sampling, return_features, decode_ahead,
                                    logprobs, eos_banned_until)
        return VerifyOutcome(result.accepted, result.next_token, result.compute_seconds, time.perf_counter() - start,
                             features=result.features, decoded=result.decoded, logprobs=result.logprobs)

    async def verify_tree(self, sequence_id: str, known_len: int, append: list[int], parents: list[int],
                          tokens: list[int], child_dists: list[Dist], sampling: SamplingConfig) -> VerifyOutcome:
        start = time.perf_counter()
        dists = [d if d is not None else ([], []) for d in child_dists] if any(d is not None for d in child_dists) else []
        call = VerifyCall(sequence_id, known_len, append, [], [], sampling, DraftTree(parents, tokens, dists))
        result = self.engine.verify_tree(call)
        return VerifyOutcome(result.accepted, result.next_token, result.compute_seconds, time.perf_counter() - start, path=result.path)

    async def release(self, sequence_id: str) -> None:
        self.engine.release(sequence_id)


class LocalProposer:
    def __init__(self, engine: DraftEngine):
        self.engine = engine

    async def propose(self, sequence_id: str, known_len: int, append: list[int], max_tokens: int,
                      min_cumulative_prob: float, temperature: float, seed: int,
                      progress: Progress | None = None, features: FeatureRows | None = None) -> DraftOutcome:
        start = time.perf_counter()
        settings = DraftSettings(max_tokens, min_cumulative_prob, temperature, seed)
        proposals = list(self.engine.propose(sequence_id, known_len, append, settings, features))
        for p in proposals if progress is not None else ():
            progress.arrived(p.token)
        dists: list[Dist] = [(p.dist_ids, p.dist_probs) if p.dist_ids is not None else None for p in proposals]
        wall = time.perf_counter() - start
        return DraftOutcome([p.token for p in proposals], dists, wall, wall, confidence=[p.cumulative_prob for p in proposals])

    async def propose_tree(self, sequence_id: str, known_len: int, append: list[int], tree: TreeSpec,
                           max_depth: int, temperature: float, seed: int) -> DraftOutcome:
        start = time.perf_counter()
        settings = TreeSettings(tree.budget, tree.top_k, tuple(tree.shape), max_depth, temperature, seed)
        drafted = self.engine.propose_tree(sequence_id, known_len, append, settings)
        dists: list[Dist] = [d if d[0] else None for d in drafted.child_dists]
        wall = time.perf_counter() - start
        return DraftOutcome(drafted.tokens, dists, drafted.compute_seconds, wall, parents=drafted.parents)

    async def release(self, sequence_id: str) -> None:
        self.engine.release(sequence_id)
