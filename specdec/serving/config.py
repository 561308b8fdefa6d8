"""One frozen config dataclass per service, built from CLI flags with matching environment variables.

Each field declares its help text and a default whose comment says why; `flag("...")` metadata
drives argparse. Precedence: command-line flag, then `SPECDEC_<SERVICE>_<FIELD>` (for example
SPECDEC_TARGET_PORT), then the default. Nothing is read at import time: `from_argv` reads the
environment when a service starts, so tests can build configs freely.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str, choices: Sequence[str] | None = None) -> Any:
    """A config field: its default, its help text, and allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


EVENT_LOOPS = ("uvloop", "asyncio")


def event_loop_option() -> Any:
    """Every service's `event_loop` field (specdec.serving.rpc.run_service)."""
    return option(
        "uvloop",
        "Event loop: uvloop (libuv: less overhead per wake-up, and every step wakes three event loops) "
        "or asyncio (the standard library's, also used where uvloop is not installed).",
        choices=EVENT_LOOPS,
    )


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def env_name(prefix: str, field: str) -> str:
    return f"{prefix}{field.upper()}"


def add_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str, env: Mapping[str, str]) -> None:
    """Adds one --flag per field of `cls`, with defaults taken from `env` where set."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        name = env_name(env_prefix, field.name)
        default = field.default
        if name in env:
            try:
                default = _parse_bool(env[name]) if kind is bool else kind(env[name])
            except ValueError as exc:
                parser.error(f"{name}={env[name]!r}: {exc}")
        help_text = f"{field.metadata.get('help', '')} [env {name}; default {default!r}]"
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, choices=field.metadata.get("choices"), help=help_text)


def from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    return cls(**{field.name: getattr(namespace, field.name) for field in dataclasses.fields(cls)})


def from_argv(cls: type[T], argv: Sequence[str] | None, env_prefix: str, prog: str, env: Mapping[str, str] | None = None) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_arguments(parser, cls, env_prefix, os.environ if env is None else env)
    return from_namespace(cls, parser.parse_args(argv))


def markdown_table(cls: type, env_prefix: str) -> str:
    """The configuration table docs/configuration.md shows, generated so that it cannot drift from the code."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        rows.append(f"| `{flag}` | `{env_name(env_prefix, field.name)}` | `{field.default!r}` | {field.metadata.get('help', '')} |")
    return "\n".join(rows)
