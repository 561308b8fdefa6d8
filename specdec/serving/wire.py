"""Engine values <-> their protobuf messages, for the values more than one service sends, and for a
Verify's result: the target writes it and the coordinator reads it, and the two translations sit
side by side so that a field added to one is seen missing from the other."""

from __future__ import annotations

from collections.abc import Iterable

from protos import specdec_pb2 as pb
from specdec.model.features import FeatureRows
from specdec.spec.request import VerifyResult
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


def verify_result_to_proto(result: VerifyResult, response: pb.VerifyResponse) -> None:
    """Writes `result` into `response` (a session's reply holds its own). What only the target knows
    (batch_size) stays behind."""
    response.accepted, response.next_token = result.accepted, result.next_token
    response.compute_seconds, response.cached_len = result.compute_seconds, result.cached_len
    if result.path:
        response.accepted_path.extend(result.path)
    if result.decoded:
        response.decoded_tokens.extend(result.decoded)
    response.ahead_passes, response.ahead_drafted, response.ahead_accepted = (
        result.ahead_passes, result.ahead_drafted, result.ahead_accepted)
    response.prediction_drafted, response.prediction_accepted = result.predicted_drafted, result.predicted_accepted
    response.ahead_seconds, response.ahead_tokens = result.ahead_seconds, result.ahead_tokens
    if result.logprobs:
        response.logprobs.extend(logprobs_to_proto(result.logprobs))
    if result.features is not None:
        f = result.features
        response.features.CopyFrom(pb.Features(start=f.start, rows=f.rows, dim=int(f.values.shape[1]), data=f.to_bytes()))


def verify_result_from_proto(response: pb.VerifyResponse, wall_seconds: float = 0.0, wire_bytes: int = 0) -> VerifyResult:
    """The target's result as the caller reads it, with what the caller measured around the call."""
    features = None
    if response.HasField("features"):
        f = response.features
        features = FeatureRows.from_wire(f.start, f.rows, f.dim, f.data, "VerifyResponse.features")
    return VerifyResult(response.accepted, response.next_token, response.cached_len, response.compute_seconds,
                        path=tuple(response.accepted_path), features=features, decoded=tuple(response.decoded_tokens),
                        logprobs=logprobs_from_proto(response.logprobs), ahead_passes=response.ahead_passes,
                        ahead_drafted=response.ahead_drafted, ahead_accepted=response.ahead_accepted,
                        predicted_drafted=response.prediction_drafted, predicted_accepted=response.prediction_accepted,
                        ahead_seconds=response.ahead_seconds, ahead_tokens=response.ahead_tokens,
                        wall_seconds=wall_seconds, wire_bytes=wire_bytes)
