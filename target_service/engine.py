"""The target engine: scores a proposal in one forward pass and verifies it. No gRPC here.

A step feeds the tokens the target has not seen (the prompt on the first call, then the previous
step's correction or bonus token) followed by the g draft tokens, all in ONE forward pass, and keeps
the logits of the last g+1 positions: position i predicts the token after draft token i-1.
"""

from __future__ import annotations

import dataclasses
import math
import time

import structlog
import torch

from specdec.errors import InvalidArgument
from specdec.kvcache import SequenceStore
from specdec.lm import CausalLM
from specdec.sampling import SamplingConfig, generator_for, target_probs
from target_service.verify import verify_greedy, verify_rejection

log = structlog.get_logger(__name__)

MAX_DRAFT_TOKENS = 32  # matches the proto's documented bound on a proposal


@dataclasses.dataclass(frozen=True)
class StepResult:
    accepted: int
    next_token: int
    cached_len: int
    compute_seconds: float


class TargetEngine:
    """Not thread-safe: the servicer runs every call on one worker thread, in arrival order."""

    def __init__(self, lm: CausalLM, max_sequences: int = 256, idle_timeout_s: float = 600.0):
        self.lm = lm
        self.store = SequenceStore(max_sequences, idle_timeout_s)

    def verify(
        self,
        sequence_id: str,
        known_len: int,
        append: list[int],
        draft_tokens: list[int],
        draft_dists: list[tuple[list[int], list[float]]],
        sampling: SamplingConfig,
    ) -> StepResult:
        start = time.perf_counter()
        self._validate(append, draft_tokens, draft_dists, sampling)
        seq = self.store.sync(sequence_id, known_len, append)
        total = len(seq.tokens) + len(draft_tokens)
        if self.lm.max_context and total > self.lm.max_context:
            raise InvalidArgument("draft_tokens", f"sequence would hold {total} tokens, past the target's context of {self.lm.max_context}")
        gamma = len(draft_tokens)
        position = len(seq.tokens)  # canonical length: the first draft token's index
        logits = self.lm.forward(seq, draft_tokens, keep=gamma + 1)  # [G+1, V]
        drafts = torch.tensor([draft_tokens], dtype=torch.long)  # [1, G]
        lens = torch.tensor([gamma])
        if sampling.greedy:
            verdict = verify_greedy(logits[None], drafts, lens)
        else:
            q = target_probs(logits, sampling)  # [G+1, V]
            p = self._dense_draft_probs(draft_tokens, draft_dists, q.shape[-1])  # [G, V]
            gen = generator_for(sampling.seed, position, "target")
            accept_u, sample_u = torch.rand(1, gamma, generator=gen), torch.rand(1, generator=gen)
            verdict = verify_rejection(q[None], drafts, p[None], lens, accept_u, sample_u)
        accepted, next_token = int(verdict.accepted[0]), int(verdict.next_tokens[0])
        seq.tokens.extend(draft_tokens[:accepted])
        seq.crop_cache(len(seq.tokens))  # roll the rejected draft positions out of the cache
        return StepResult(accepted, next_token, len(seq.tokens), time.perf_counter() - start)

    def release(self, sequence_id: str) -> bool:
        return self.store.release(sequence_id)

    def warm_up(self) -> None:
        """One prefill and one verification so the first real request pays no lazy initialisation."""
        self.verify("__warmup__", 0, [0, 1, 2, 3], [4, 5], [], SamplingConfig())
        self.store.release("__warmup__", retire=False)  # warm-ups may run again

    def _validate(self, append, draft_tokens, draft_dists, sampling: SamplingConfig) -> None:
        vocab = self.lm.vocab_size
        for field, ids in (("append_tokens", append), ("draft_tokens", draft_tokens)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidArgument(field, f"token id {bad[0]} outside the target's vocabulary [0, {vocab})")
        if len(draft_tokens) > MAX_DRAFT_TOKENS:
            raise InvalidArgument("draft_tokens", f"at most {MAX_DRAFT_TOKENS} per call, got {len(draft_tokens)}")
        if draft_dists and len(draft_dists) != len(draft_tokens):
            raise InvalidArgument("draft_dists", f"one per draft token: got {len(draft_dists)} for {len(draft_tokens)} tokens")
        for i, (ids, probs) in enumerate(draft_dists):
            if (ids or probs) and not _is_distribution(ids, probs, vocab):
                raise InvalidArgument(f"draft_dists[{i}]", "needs distinct in-vocabulary ids, one prob each, in [0, 1], summing to 1")
            if ids and not any(t == draft_tokens[i] and p > 0 for t, p in zip(ids, probs)):
                raise InvalidArgument(f"draft_dists[{i}]", f"draft token {draft_tokens[i]} has probability 0 in the p it was drawn from")
        if not sampling.temperature >= 0:  # also rejects NaN
            raise InvalidArgument("sampling.temperature", f"must be >= 0, got {sampling.temperature}")
        if sampling.top_k < 0:
            raise InvalidArgument("sampling.top_k", f"must be >= 0, got {sampling.top_k}")
        if not 0 < sampling.top_p <= 1:
            raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {sampling.top_p}")

    @staticmethod
    def _dense_draft_probs(tokens: list[int], dists: list[tuple[list[int], list[float]]], vocab: int) -> torch.Tensor:
        """[G, V] draft probabilities; a token sent without a distribution was drawn with p = 1 (one-hot)."""
        p = torch.zeros(len(tokens), vocab)
        for i, token in enumerate(tokens):
            ids, probs = dists[i] if dists else ([], [])
            if ids:
                p[i, torch.tensor(ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float32)
            else:
                p[i, token] = 1.0
        return p


def _is_distribution(ids: list[int], probs: list[float], vocab: int) -> bool:
    """A sparse p the rejection sampler can use: NaN, inf or mass that does not sum to 1 would skew it."""
    return (
        len(ids) == len(probs) == len(set(ids))
        and all(0 <= t < vocab for t in ids)
        and all(0 <= p <= 1 for p in probs)  # also rejects NaN
        and abs(math.fsum(probs) - 1) <= 1e-3
    )
