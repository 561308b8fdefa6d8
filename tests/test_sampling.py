"""specdec's logits warping must equal what plain sampling (transformers' processors) does."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.maths.sampling import SamplingConfig, derive_seed, target_probs, truncated_probs, warp_logits


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.2, 0, 0.9), (0.5, 20, 0.5), (2.0, 3, 0.3), (1.0, 1, 1.0)])
def test_warp_matches_transformers_processors(temperature, top_k, top_p):
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :4] = 2.5  # ties at the top-k boundary are kept, as transformers keeps them
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    expected = processors(None, logits.clone())
    ours = warp_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = ~torch.isinf(ours)
    torch.testing.assert_close(ours[finite], expected[finite])


def test_target_probs_sum_to_one_and_respect_top_k():
    probs = target_probs(torch.randn(3, 50), SamplingConfig(temperature=0.8, top_k=7))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert ((probs > 0).sum(-1) == 7).all()


def test_greedy_cannot_be_warped():
    with pytest.raises(ValueError):
        warp_logits(torch.randn(4), 0.0, 0, 1.0)


def test_truncated_probs_are_the_renormalised_top_k():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    ids, probs = truncated_probs(logits, temperature=1.0, top_k=2)
    assert ids.tolist() == [1, 3]
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([3.0, 2.0]), -1))


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed(1, 10, "target") == derive_seed(1, 10, "target")
    assert len({derive_seed(1, 10, "target"), derive_seed(1, 11, "target"), derive_seed(2, 10, "target"), derive_seed(1, 10, "draft")}) == 4
    assert 0 <= derive_seed(2**64 - 1, 0, "x") < 2**63


@pytest.mark.parametrize(("sampling", "field"), [
    (SamplingConfig(temperature=float("nan")), "sampling.temperature"),
    (SamplingConfig(temperature=-0.5), "sampling.temperature"),
    (SamplingConfig(temperature=float("inf")), "sampling.temperature"),
    (SamplingConfig(temperature=1e39), "sampling.temperature"),  # finite, but infinity as float32
    (SamplingConfig(top_k=-1), "sampling.top_k"),
    (SamplingConfig(top_p=0.0), "sampling.top_p"),
    (SamplingConfig(top_p=1.5), "sampling.top_p"),
])
def test_one_sampling_check_names_the_wire_field(sampling, field):
    """The coordinator's validator and the target engine call this one check: the same field, the same error."""
    from specdec.errors import InvalidArgument
    from specdec.maths.sampling import check_sampling

    with pytest.raises(InvalidArgument) as caught:
        check_sampling(sampling)
    assert caught.value.field == field
    assert check_sampling(SamplingConfig(0.7, 5, 0.9, 1)) == SamplingConfig(0.7, 5, 0.9, 1)
