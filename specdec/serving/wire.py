"""Engine values <-> their protobuf messages: the values more than one service sends, and the step's
calls and result (specdec/calls/request.py): a ProposeCall, a VerifyCall and a VerifyResult. Each
one's two translations sit side by side, so that a field added to one is seen missing from the
other; a field the engine cannot take as it comes (features' bytes) is refused here, by its name."""

from __future__ import annotations

from collections.abc import Iterable

from protos import specdec_pb2 as pb
from specdec.model.features import FeatureRows
from specdec.calls.request import ProposeCall, TreeSettings, VerifyCall, VerifyResult
from specdec.maths.sampling import SamplingConfig, TokenLogprob
from specdec.maths.tree import EMPTY_DIST, DraftTree, SparseDist


def sampling_to_proto(sampling: SamplingConfig) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed)


def sampling_from_proto(params: pb.SamplingParams) -> SamplingConfig:
    """Unset fields take the documented defaults; range checks happen in the engine."""
    return SamplingConfig(
        temperature=params.temperature if params.HasField("temperature") else 0.0,
        top_k=params.top_k if params.HasField("top_k") else 0,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        seed=params.seed if params.HasField("seed") else 0,
    )


def features_to_proto(rows: FeatureRows) -> pb.Features:
    return pb.Features(start=rows.start, rows=rows.rows, dim=int(rows.values.shape[1]), data=rows.to_bytes())


def features_from_proto(message: pb.Features, field: str) -> FeatureRows:
    """Refuses sizes that do not match the bytes, or values that are not finite, naming `field`."""
    return FeatureRows.from_wire(message.start, message.rows, message.dim, message.data, field)


def dists_from_proto(dists: Iterable[pb.SparseDistribution]) -> list[SparseDist]:
    """Sparse distributions as the engines take them; an empty one is one-hot (EMPTY_DIST)."""
    return [(list(d.token_ids), list(d.probs)) if d.token_ids else EMPTY_DIST for d in dists]


def logprobs_to_proto(logprobs: Iterable[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


def logprobs_from_proto(messages: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs))) for m in messages)


def propose_call_to_proto(call: ProposeCall) -> pb.ProposeRequest | pb.ProposeTreeRequest:
    """The wire's request for `call`: a ProposeRequest for a chain, a ProposeTreeRequest for a tree
    (the draft length is then TreeParams.max_depth). A tree call carries no min_cumulative_prob
    (the wire has no field for it): asking that is the caller's bug."""
    if call.tree is None:
        request = pb.ProposeRequest(sequence_id=call.sequence_id, known_len=call.known_len, append_tokens=call.append,
                                    max_tokens=call.draft_length, min_cumulative_prob=call.min_cumulative_prob,
                                    temperature=call.temperature, seed=call.seed)
        if call.features is not None:
            request.features.CopyFrom(features_to_proto(call.features))
        return request
    if call.min_cumulative_prob:
        raise ValueError("a tree proposal takes no min_cumulative_prob")
    tree = pb.TreeParams(budget=call.tree.budget, top_k=call.tree.top_k, shape=call.tree.shape, max_depth=call.draft_length)
    request = pb.ProposeTreeRequest(sequence_id=call.sequence_id, known_len=call.known_len, append_tokens=call.append,
                                    tree=tree, temperature=call.temperature, seed=call.seed)
    if call.features is not None:
        request.features.CopyFrom(features_to_proto(call.features))
    return request


def propose_call_from_proto(request: pb.ProposeRequest | pb.ProposeTreeRequest) -> ProposeCall:
    """The draft engine's call for a Propose (a chain) or a ProposeTree (a tree) request. Features
    whose bytes do not match their sizes are refused here, by name; ranges are the engine's to
    check (specdec/calls/checks.py), so that an in-process call meets the same ones."""
    features = features_from_proto(request.features, "features") if request.HasField("features") else None
    if isinstance(request, pb.ProposeTreeRequest):
        t = request.tree
        return ProposeCall(request.sequence_id, request.known_len, list(request.append_tokens), t.max_depth,
                           temperature=request.temperature, seed=request.seed, features=features,
                           tree=TreeSettings(t.budget, t.top_k, tuple(t.shape)))
    return ProposeCall(request.sequence_id, request.known_len, list(request.append_tokens), request.max_tokens,
                       request.min_cumulative_prob, request.temperature, request.seed, features)


def verify_call_to_proto(call: VerifyCall) -> pb.VerifyRequest:
    """The wire's VerifyRequest for `call`. Distributions travel only when sampling, and only if some
    token has one: the target takes a missing one as one-hot (EMPTY_DIST). What only the target
    sets (prefill, lookup_match) stays behind."""
    request = pb.VerifyRequest(sequence_id=call.sequence_id, known_len=call.known_len, append_tokens=call.append,
                               draft_tokens=call.draft_tokens, sampling=sampling_to_proto(call.sampling),
                               return_features=call.return_features, decode_ahead=call.decode_ahead, logprobs=call.logprobs,
                               eos_banned_until=call.eos_banned_until, lookup_max_tokens=call.lookup_draft_length,
                               lookup_costs=call.lookup_costs, decode_ahead_passes=call.decode_ahead_passes,
                               lookup_source=call.lookup_source)
    sampled = not call.sampling.greedy
    if sampled and any(ids for ids, _ in call.draft_dists):
        for ids, probs in call.draft_dists:
            request.draft_dists.add(token_ids=ids, probs=probs)
    if call.tree is not None:
        request.draft_tree.parents.extend(call.tree.parents)
        request.draft_tree.tokens.extend(call.tree.tokens)
        if sampled and any(ids for ids, _ in call.tree.child_dists):
            for ids, probs in call.tree.child_dists:
                request.draft_tree.child_dists.add(token_ids=ids, probs=probs)
    return request


def verify_call_from_proto(request: pb.VerifyRequest) -> VerifyCall:
    """The target engine's call for a VerifyRequest. Distributions stay as sent (an empty id list
    with probabilities included): the engine's checks (specdec/calls/checks.py) name a bad one."""
    tree = None
    if request.HasField("draft_tree"):
        t = request.draft_tree
        tree = DraftTree(list(t.parents), list(t.tokens), [(list(d.token_ids), list(d.probs)) for d in t.child_dists])
    return VerifyCall(
        request.sequence_id,
        request.known_len,
        list(request.append_tokens),
        list(request.draft_tokens),
        [(list(d.token_ids), list(d.probs)) for d in request.draft_dists],
        sampling_from_proto(request.sampling),
        tree,
        request.return_features,
        request.decode_ahead,
        request.logprobs if request.HasField("logprobs") else None,
        request.eos_banned_until,
        lookup_draft_length=request.lookup_max_tokens,
        lookup_costs=tuple(request.lookup_costs),
        decode_ahead_passes=request.decode_ahead_passes,
        lookup_source=tuple(request.lookup_source),
    )


def decode_run_call_from_proto(message: pb.DecodeRun) -> VerifyCall:
    """What every call of a run started by `message` shares (target_service/runs.py fills in each
    call's tokens): a run starts a fresh sequence, so its calls build on known_len 0."""
    return VerifyCall(message.sequence_id, 0, [], [], [], sampling_from_proto(message.sampling),
                      logprobs=message.logprobs if message.HasField("logprobs") else None,
                      eos_banned_until=message.eos_banned_until, lookup_draft_length=message.lookup_max_tokens,
                      lookup_costs=tuple(message.lookup_costs))


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
        response.features.CopyFrom(features_to_proto(result.features))


def verify_result_from_proto(response: pb.VerifyResponse, wall_seconds: float = 0.0, wire_bytes: int = 0) -> VerifyResult:
    """The target's result as the caller reads it, with what the caller measured around the call."""
    features = features_from_proto(response.features, "VerifyResponse.features") if response.HasField("features") else None
    return VerifyResult(response.accepted, response.next_token, response.cached_len, response.compute_seconds,
                        path=tuple(response.accepted_path), features=features, decoded=tuple(response.decoded_tokens),
                        logprobs=logprobs_from_proto(response.logprobs), ahead_passes=response.ahead_passes,
                        ahead_drafted=response.ahead_drafted, ahead_accepted=response.ahead_accepted,
                        predicted_drafted=response.prediction_drafted, predicted_accepted=response.prediction_accepted,
                        ahead_seconds=response.ahead_seconds, ahead_tokens=response.ahead_tokens,
                        wall_seconds=wall_seconds, wire_bytes=wire_bytes)
