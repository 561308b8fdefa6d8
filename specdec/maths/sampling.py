"""Turning logits into the distribution a request samples from, and seeding the draws.

The target must sample exactly as plain decoding would, so this follows Hugging Face
`generate()`'s order and tie rules: temperature, then top-k (ties with the k-th logit are kept),
then top-p (drop the low tail whose cumulative probability is <= 1 - top_p, always keeping the most
likely token). tests/test_sampling.py checks it against transformers' own logits processors.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from specdec.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """A request's sampling parameters, already validated (check_sampling)."""

    temperature: float = 0.0  # 0 means greedy: the argmax, no randomness at all
    top_k: int = 0  # 0 means no top-k truncation
    top_p: float = 1.0  # 1.0 means no nucleus truncation
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# The largest temperature a float32 division takes: past it the logits are divided by infinity, a
# banned token's -inf logit becomes NaN, and a request with min_tokens sampled at temperature inf
# drew a negative token id from the NaN distribution and failed with an internal error.
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)


def check_temperature(temperature: float, field: str = "temperature") -> None:
    """The one temperature check of every service: a finite number >= 0 (NaN, which `< 0` lets
    through, and infinity would poison every probability)."""
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(field, f"must be a finite number >= 0, got {temperature}")


def check_sampling(sampling: SamplingConfig, prefix: str = "sampling.") -> SamplingConfig:
    """The request checks the coordinator's validator and the target engine share: the field names
    are the wire's (`prefix` + name), so a client sees the same error from either. Returns `sampling`."""
    check_temperature(sampling.temperature, prefix + "temperature")
    if sampling.top_k < 0:
        raise InvalidArgument(prefix + "top_k", f"must be >= 0, got {sampling.top_k}")
    if not 0 < sampling.top_p <= 1:
        raise InvalidArgument(prefix + "top_p", f"must be in (0, 1], got {sampling.top_p}")
    return sampling


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32. [..., V] -> [..., V].

    A tiny temperature (1e-40 is a valid float32) overflows the division to +inf, and a softmax over
    +inf is NaN; then the scores are shifted so the largest is 0 first: the same softmax in exact
    arithmetic, whose limit (all mass on the argmax) it reaches instead of NaN. Sane temperatures
    take the plain division, bit for bit what plain sampling computes.
    """
    scores = logits.float() / temperature
    if torch.isposinf(scores).any():
        shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)  # <= 0, so never +inf
        scores = shifted / temperature
    return scores


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Applies temperature, top-k and top-p; removed tokens get -inf. logits: [..., V] -> [..., V]."""
    if temperature <= 0:
        raise ValueError("warp_logits is for sampling; greedy decoding takes the argmax")
    scores = scale_logits(logits, temperature)
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)  # ascending
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - top_p)
        remove_sorted[..., -1:] = False  # keep at least the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def target_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The distribution q the target samples from. logits: [..., V] -> probs [..., V] (float32)."""
    return torch.softmax(warp_logits(logits, config.temperature, config.top_k, config.top_p), dim=-1)


def truncated_probs(logits: torch.Tensor, temperature: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's sampling distribution, kept sparse: the top-k tokens renormalised.

    Sampling from the truncated distribution (rather than the full softmax) is what lets the draft
    send its p compactly and still exactly: outside the k tokens, p is truly 0.
    logits: [V] -> (token_ids [k], probs [k]) sorted by probability, descending.
    """
    k = min(top_k, logits.shape[-1])
    values, ids = torch.topk(scale_logits(logits, temperature), k, dim=-1)
    return ids, torch.softmax(values, dim=-1)


def derive_seed(seed: int, position: int, stream: str) -> int:
    """A 63-bit seed for one draw site, from the request seed, the canonical position and a stream.

    Seeding per (request, position) instead of keeping a generator per sequence makes seeded
    results independent of which replica served a step, of restarts, and of cache refills: only
    the canonical tokens decide the next draw.
    """
    digest = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator_for(seed: int, position: int, stream: str) -> torch.Generator:
    """A CPU generator seeded for one draw site (see derive_seed)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(derive_seed(seed, position, stream))
    return generator


def ban_tokens(logits: torch.Tensor, first_position: int, banned_until: int, token_ids) -> torch.Tensor:
    """`logits` [N, V] with `token_ids` at -inf in the rows that score positions below `banned_until`
    (row i scores position first_position + i). A request's min_tokens bans its end-of-sequence
    tokens this way: the target's distribution itself changes there, so verification stays exact
    (a draft that proposes a banned token is simply never accepted)."""
    rows = min(logits.shape[0], banned_until - first_position)
    if rows <= 0 or not token_ids:
        return logits
    logits = logits.clone()
    logits[:rows, list(token_ids)] = float("-inf")
    return logits


def chosen_logprobs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Log-probabilities [N, V] of the distribution a token is chosen from: after temperature,
    top-k and top-p when sampling (what vLLM calls processed log-probabilities; truncated tokens
    get -inf), the plain log-softmax when greedy (the argmax has no distribution of its own)."""
    if config.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(warp_logits(logits, config.temperature, config.top_k, config.top_p), dim=-1)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the `top` most likely (token, log-probability) pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """One TokenLogprob per token: tokens[i] read from row i of `logprobs` [>= len(tokens), V]."""
    if not tokens:
        return []
    rows = logprobs[: len(tokens)]
    own = rows.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None]).squeeze(1).tolist()
    if top_n:
        values, ids = torch.topk(rows, min(top_n, rows.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, own, tops)]
