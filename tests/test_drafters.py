"""Every drafter is a Drafter (draft_service/drafters/base.py): it declares each attribute the
engine and the loader read, so neither probes for one. (The other vocabulary's drafter is checked
in tests/test_other_vocab.py, beside the tokenizers it needs.)"""

from __future__ import annotations

import pytest
import torch

from draft_service.drafters.base import Drafter
from specdec.calls.request import ProposeCall
from draft_service.drafters.feature import FeatureDrafter
from draft_service.drafters.model import ModelDrafter
from draft_service.drafters.ngram import NgramDrafter
from specdec.model.lm import CausalLM
from tests import tiny

CPU = torch.device("cpu")
ATTRIBUTES = ("kind", "vocab_size", "needs_features", "feature_dim", "lm", "source", "inline")


def drafters() -> dict[str, Drafter]:
    target = tiny.one_layer_target(seed=3)
    return {
        "model": ModelDrafter(CausalLM(target, CPU)),
        "ngram": NgramDrafter(),
        "feature": FeatureDrafter(tiny.feature_draft_of(target), CPU, [tiny.EOS]),
    }


@pytest.mark.parametrize("kind", ["model", "ngram", "feature"])
def test_each_drafter_implements_the_protocol(kind):
    drafter = drafters()[kind]
    assert isinstance(drafter, Drafter)
    for name in ATTRIBUTES:
        assert hasattr(drafter, name), name
    assert drafter.kind == kind
    assert drafter.needs_features == (kind == "feature") and (drafter.feature_dim > 0) == drafter.needs_features
    assert drafter.inline == (kind == "ngram") and (drafter.lm is None) == (kind == "ngram")


def test_only_the_plain_model_drafter_shares_forwards():
    greedy, sampled = ProposeCall("s", 0, [], 4), ProposeCall("s", 0, [], 4, temperature=0.8)
    found = {kind: (d.batches(greedy), d.batches(sampled)) for kind, d in drafters().items()}
    assert found == {"model": (True, True), "ngram": (False, False), "feature": (False, False)}
    staged = ModelDrafter(CausalLM(tiny.one_layer_target(seed=3), CPU), staged=True)
    assert (staged.batches(greedy), staged.batches(sampled)) == (False, True)
