"""Engine values <-> their protobuf messages, for the values more than one service sends."""

from __future__ import annotations

from collections.abc import Iterable

from protos import specdec_pb2 as pb
from specdec.spec.sampling import TokenLogprob


def logprobs_to_proto(logprobs: Iterable[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


def logprobs_from_proto(messages: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs))) for m in messages)
