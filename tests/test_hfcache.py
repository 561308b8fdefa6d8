"""specdec.model.hfcache: the cache goes to a forward under the name that forward takes, and comes back
from either field, so specdec runs on transformers before and after 5.24's rename."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec.model.hfcache import cache_kwargs, output_field, returned_cache
from specdec.kv.store import Sequence
from specdec.model.lm import CausalLM
from tests import tiny


class NewName(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=False):
        return input_ids


class OldName(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=False):
        return input_ids


def test_the_cache_goes_under_the_name_the_forward_takes():
    assert cache_kwargs(NewName(), "c") == {"cache": "c"}
    assert cache_kwargs(OldName(), "c") == {"past_key_values": "c"}


def test_the_returned_cache_is_read_from_either_field():
    @dataclasses.dataclass
    class New:
        cache: object = None

    @dataclasses.dataclass
    class Old:
        past_key_values: object = None

    assert returned_cache(New("c")) == "c" and returned_cache(Old("c")) == "c"
    assert output_field(New) == "cache" and output_field(Old) == "past_key_values"
    assert output_field(CausalLMOutputWithPast) in {"cache", "past_key_values"}


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_installed_transformers_decodes_with_no_deprecation_warning():
    """Every step of the engines goes through these helpers: with the name the installed release
    expects, transformers logs nothing about the cache's name."""
    model = tiny.tiny_pair(seed=1)[0]
    lm = CausalLM(model, torch.device("cpu"))
    prompt = tiny.prompts(1, seed=3)[0]
    seq = Sequence("s", list(prompt))
    records = Records()
    library = logging.getLogger("transformers")
    library.addHandler(records)
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process: let it warn again
    try:
        with warnings.catch_warnings(record=True) as caught:  # the renamed argument: a FutureWarning
            warnings.simplefilter("always")
            first = lm.forward(seq, [], keep=1)
            seq.tokens.append(int(first[-1].argmax()))
            second = lm.forward(seq, [], keep=1)
    finally:
        library.removeHandler(records)
    messages = records.messages + [str(w.message) for w in caught]  # the renamed output field: a log line
    assert not [m for m in messages if "past_key_values" in m]
    # and the cache came back: the second step fed one position on top of the prompt
    assert seq.cached == len(prompt) + 1 and second.shape == first.shape
    assert int(second[-1].argmax()) == tiny.reference_greedy(model, prompt, 2)[1]
