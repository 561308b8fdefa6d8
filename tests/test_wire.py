"""The step's calls on the wire (specdec/serving/wire.py): a ProposeCall and a VerifyCall come back
from their protobuf as they went in, field for field, and a field the engine cannot take as sent is
refused by its name. What a translation leaves behind is said in its docstring and checked here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from protos import specdec_pb2 as pb
from specdec.errors import InvalidArgument
from specdec.model.features import FeatureRows
from specdec.serving.wire import (propose_call_from_proto, propose_call_to_proto, verify_call_from_proto,
                                  verify_call_to_proto)
from specdec.calls.request import ProposeCall, TreeSettings, VerifyCall
from specdec.maths.sampling import SamplingConfig
from specdec.maths.tree import DraftTree


def _wire(message):
    """Through bytes, as a service receives it."""
    return type(message).FromString(message.SerializeToString())


def test_a_chain_propose_call_round_trips_with_its_features():
    rows = FeatureRows(2, torch.tensor([[0.5, -1.0, 2.0], [0.25, 0.0, 3.0]]))  # exact in float16
    call = ProposeCall("s", 3, [7, 8], 5, 0.25, 0.75, 11, rows)  # values float32 holds exactly
    request = propose_call_to_proto(call)
    assert isinstance(request, pb.ProposeRequest) and request.max_tokens == 5  # the wire's name for the draft length
    back = propose_call_from_proto(_wire(request))
    assert torch.equal(back.features.values, rows.values) and back.features.start == 2
    assert dataclasses.replace(back, features=None) == dataclasses.replace(call, features=None)
    plain = ProposeCall("s", 0, [1], 4)
    assert propose_call_from_proto(_wire(propose_call_to_proto(plain))) == plain


def test_a_tree_propose_call_round_trips_through_propose_tree():
    call = ProposeCall("t", 4, [9], 6, temperature=0.5, seed=3, tree=TreeSettings(12, 3, (3, 2, 1)))
    request = propose_call_to_proto(call)
    assert isinstance(request, pb.ProposeTreeRequest) and request.tree.max_depth == 6
    assert propose_call_from_proto(_wire(request)) == call
    rows = FeatureRows(1, torch.tensor([[0.5, -1.0, 2.0]]))  # a feature draft's tree ask
    back = propose_call_from_proto(_wire(propose_call_to_proto(dataclasses.replace(call, features=rows))))
    assert torch.equal(back.features.values, rows.values) and back.features.start == 1 and back.tree == call.tree


def test_a_tree_call_with_chain_only_fields_is_the_callers_bug():
    with pytest.raises(ValueError):
        propose_call_to_proto(ProposeCall("t", 0, [1], 2, 0.5, tree=TreeSettings(4)))


def test_features_whose_bytes_do_not_match_are_refused_by_name():
    request = pb.ProposeRequest(sequence_id="s", max_tokens=2, features=pb.Features(start=0, rows=2, dim=3, data=b"\0" * 6))
    with pytest.raises(InvalidArgument) as info:
        propose_call_from_proto(request)
    assert info.value.field == "features"


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.75, top_k=5, top_p=0.5, seed=4)])
def test_a_verify_call_round_trips(sampling):
    dists = [([3, 4], [0.75, 0.25]), ([5], [1.0])] if not sampling.greedy else []
    chain = VerifyCall("v", 2, [1], [3, 5], dists, sampling, return_features=True, decode_ahead=3, logprobs=2,
                       eos_banned_until=9, lookup_draft_length=4, lookup_costs=(1.0, 1.5), decode_ahead_passes=2,
                       lookup_source=(7, 8))
    assert verify_call_from_proto(_wire(verify_call_to_proto(chain))) == chain
    tree = DraftTree([-1, 0, 0], [3, 4, 6], [([3, 4], [0.5, 0.5]), ([4, 6], [0.5, 0.5]), ((), ()), ((), ())]
                     if not sampling.greedy else [])
    call = VerifyCall("v", 2, [1], [], [], sampling, tree)
    back = verify_call_from_proto(_wire(verify_call_to_proto(call)))
    assert (back.tree.parents, back.tree.tokens) == (tree.parents, tree.tokens)
    assert [tuple(map(tuple, d)) for d in back.tree.child_dists] == [tuple(map(tuple, d)) for d in tree.child_dists]
    assert dataclasses.replace(back, tree=None) == dataclasses.replace(call, tree=None)
