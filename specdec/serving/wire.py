"""Engine values <-> their protobuf messages, for the values more than one service sends."""

from __future__ import annotations

from collections.abc import Iterable

from protos import specdec_pb2 as pb
from specdec.spec.sampling import SamplingConfig, TokenLogprob
from specdec.spec.tree import EMPTY_DIST, SparseDist


def sampling_from_proto(params: pb.SamplingParams) -> SamplingConfig:
    """Unset fields take the documented defaults; range checks happen in the engine."""
    return SamplingConfig(
        temperature=params.temperature if params.HasField("temperature") else 0.0,
        top_k=params.top_k if params.HasField("top_k") else 0,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        seed=params.seed if params.HasField("seed") else 0,
    )


def dists_from_proto(dists: Iterable[pb.SparseDistribution]) -> list[SparseDist]:
    """Sparse distributions as the engines take them; an empty one is one-hot (EMPTY_DIST)."""
    return [(list(d.token_ids), list(d.probs)) if d.token_ids else EMPTY_DIST for d in dists]


def logprobs_to_proto(logprobs: Iterable[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


def logprobs_from_proto(messages: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs))) for m in messages)
