"""Handing a KV cache to a transformers model and taking it back, under either of its names.

transformers 5.24 renamed forward()'s `past_key_values` argument and output field to `cache`; the
old name still works until 5.40 but logs a deprecation warning (once per process; a CI run had
756 of them, one per test process and worker). specdec feeds caches to transformers models and to
its own modules that keep the old name (PrunedDraft), so every call site asks here which name the
callee takes instead of pinning either transformers release.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any


@functools.cache
def _argument(forward) -> str:
    """`cache` if this forward takes it (transformers >= 5.24), else `past_key_values`."""
    try:
        parameters = inspect.signature(forward).parameters  # follows the deprecation decorator's __wrapped__
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict[str, Any]:
    """The keyword argument that hands `cache` to `model`'s forward."""
    return {_argument(type(model).forward): cache}


def returned_cache(output):
    """The cache a forward returned (None if it returned none), read from the field the output's
    class declares: the old name is a property under 5.24 that logs a deprecation."""
    return getattr(output, output_field(type(output)))


@functools.cache
def output_field(output_class: type) -> str:
    """The name an output class (CausalLMOutputWithPast, ...) gives its cache field."""
    names = {field.name for field in dataclasses.fields(output_class)}
    return "cache" if "cache" in names else "past_key_values"
