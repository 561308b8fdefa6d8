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

from specdec.model.formats import FORMATS

T = TypeVar("T")


def option(default: Any, help: str, choices: Sequence[str] | None = None) -> Any:
    """A config field: its default, its help text, and allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


EVENT_LOOPS = ("uvloop", "asyncio")


def event_loop_option() -> Any:
    """Every service's `event_loop` field (specdec.serving.server.run_service)."""
    return option(
        "uvloop",
        "Event loop: uvloop (libuv: less overhead per wake-up, and every step wakes three event loops) "
        "or asyncio (the standard library's, also used where uvloop is not installed).",
        choices=EVENT_LOOPS,
    )


def weights_option(draft: bool = False) -> Any:
    """The model services' `weights` field (specdec/model/cpu/compact.py says what each format is); the
    draft's `auto` also covers feature drafts (specdec/model/feature_draft.py: COMPACT_WEIGHTS)."""
    feature = ("; a feature draft (no GGUF of its own): int8-a8 with those instructions, else int8, its fastest "
               "formats measured, which change only its proposals, never the output") if draft else ""
    return option(
        "auto",
        "What the CPU GEMM kernel reads the linear layers' weights as. auto: for a model loaded from a GGUF file, "
        "its own blocks, as gguf-a8 on a CPU with 8-bit dot-product instructions (AVX-512 VNNI or AVX-VNNI) and as "
        f"gguf without them, the fastest exact format on each{feature}; else fp32 (a GPU always serves fp32 here). "
        "fp32: the tokens transformers' generate() gives; bf16 or f16; int8 or q4 (blocks of "
        "32 with their own scales, quantized at load); gguf (the blocks of the GGUF file the model came from, as "
        "they are); int8-a8, q4-a8, gguf-a8 (the same weights against activations rounded to int8 per block of 32, "
        "multiplied with the CPU's 8-bit dot-product instructions, as llama.cpp computes). Fewer bytes a weight and "
        "fewer operations decode faster; the model served is the model in that format, and `specdec bench "
        "--weights` prints each format's agreement with fp32.",
        choices=("auto", *FORMATS),
    )


def compute_threads_option() -> Any:
    """The model services' `compute_threads` field (specdec/serving/threads.py)."""
    return option(
        0,
        "Intra-op threads of the compute thread (torch's and specdec's CPU kernel's OpenMP team); 0: torch's "
        "default, one per core. Fewer leave cores to the processes beside the service (a draft service on the "
        "same machine); one thread decodes without any parallel region to wait at (on 2 cores: 0.8x the speed "
        "of two on a quiet machine).",
    )


NUMERICS = ("exact", "fast")


def numerics_option() -> Any:
    """The model services' `numerics` field (specdec/model/gpu/static.py says how exact is kept)."""
    return option(
        "exact",
        "GPU only. exact: every forward of a Llama-family model runs as passes of --pass-rows rows over a static "
        "KV cache, replayed as one CUDA graph, with attention over each query's keys in a fixed order, so a "
        "position's logits are the same bits decoded alone, verified in a draft or batched with other sequences, "
        "and greedy speculation returns exactly the target's own tokens. fast: transformers' own forward "
        "(cuBLAS and SDPA choose kernels by shape), which can flip a greedy near-tie, so speculative output may "
        "differ from decoding alone. CPUs are row-exact with either.",
        choices=NUMERICS,
    )


def static_options() -> tuple[Any, Any, Any]:
    """--pass-rows, --static-slots, --static-context: the shape of --numerics exact on a GPU."""
    return (
        option(64, "GPU, --numerics exact: token rows in every forward pass (a prompt goes in chunks of this "
                   "many; a decode step pads to it). One shape is what makes rows exact and one CUDA graph serve all."),
        option(32, "GPU, --numerics exact: sequences whose KV caches the GPU holds at once (one static slot "
                   "each); past it the least recently used is evicted and re-filled on demand."),
        option(0, "GPU, --numerics exact: positions each slot holds (0: the model's context, at most 8192). "
                  "Memory: slots x positions x layers x 2 x kv heads x head dim x 2 bytes."),
    )


def check_static(numerics: str, pass_rows: int, static_slots: int, static_context: int) -> None:
    if numerics not in NUMERICS:
        raise ValueError(f"--numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if not 1 <= pass_rows <= 4096:
        raise ValueError(f"--pass-rows must be in [1, 4096], got {pass_rows}")
    if static_slots < 1:
        raise ValueError(f"--static-slots must be >= 1, got {static_slots}")
    if static_context < 0:
        raise ValueError(f"--static-context must be >= 0, got {static_context}")


def check_weights(weights: str, packed_gemm_rows: int) -> None:
    """A compact format is read by the kernel alone: with the kernel off it could only be served as fp32."""
    if weights not in ("fp32", "auto") and not packed_gemm_rows:
        raise ValueError(f"--weights {weights} is read by specdec's GEMM kernel: it needs --packed-gemm-rows > 0")


def backend_token_option(role: str) -> Any:
    """Every service's `backend_token` field (specdec/serving/backend_auth.py); `role` says what this service does with it."""
    return option(
        "",
        f"Shared secret of the service-to-service calls: {role} The same value on the coordinator, the draft and "
        "the target, best from the environment (a flag shows in `ps`); surrounding whitespace is dropped. Not "
        "encryption: across networks others can read, use it with TLS. Empty: off.",
    )


def check_backend_token(token: str) -> None:
    """Printable ASCII without spaces: gRPC metadata carries nothing else, and a token it cannot carry
    would fail every call instead of the start. The message never shows the token."""
    if not all("!" <= c <= "~" for c in token.strip()):
        raise ValueError("--backend-token must be printable ASCII without spaces (it travels in gRPC metadata)")

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


def log_format_option() -> Any:
    """Every service's `log_format` field (specdec.serving.logs.configure)."""
    return option("auto", "auto, json or console.", choices=LOG_FORMATS)


def log_level_option() -> Any:
    """Every service's `log_level` field: a fixed set, so a typo is a usage error before anything starts."""
    return option("info", "debug, info, warning or error.", choices=LOG_LEVELS)


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean (1/0, true/false, yes/no, on/off)"}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _BOOL_WORDS:
        return _BOOL_WORDS[lowered]
    raise ValueError(f"not a boolean: {text!r}")


def env_name(prefix: str, field: str) -> str:
    return f"{prefix}{field.upper()}"


def env_value(name: str, text: str, kind: Any, choices: Sequence[Any] | None = None) -> Any:
    """An environment variable's text as its flag would take it. argparse checks `choices` only for
    values given on the command line, never for defaults, so a default from the environment is
    checked here; ValueError names the variable and what it accepts."""
    try:
        value = _parse_bool(text) if kind is bool else kind(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ValueError(f"{name}={text!r}: must be {_KIND_NAMES.get(kind, 'a valid value')}") from None
    if choices is not None and value not in choices:
        raise ValueError(f"{name}={text!r}: must be one of {', '.join(map(str, choices))}")
    return value


def add_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str, env: Mapping[str, str]) -> None:
    """Adds one --flag per field of `cls`, with defaults taken from `env` where set."""
    hints = typing.get_type_hints(cls)
    errors = []  # reported once every flag is added, so the usage line shows them all
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        name = env_name(env_prefix, field.name)
        default = field.default
        if name in env:
            try:
                default = env_value(name, env[name], kind, field.metadata.get("choices"))
            except ValueError as exc:
                errors.append(str(exc))
        shown = "(set)" if "token" in field.name and default else repr(default)  # --help must not print a secret
        help_text = f"{field.metadata.get('help', '')} [env {name}; default {shown}]"
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, choices=field.metadata.get("choices"), help=help_text)
    if errors:
        parser.error("; ".join(errors))


def env_defaults(parser: argparse.ArgumentParser, prefix: str = "SPECDEC_", env: Mapping[str, str] | None = None,
                 skip: Sequence[str] = ()) -> None:
    """The same precedence for a tool's own parser (`specdec up`, `generate`, `bench`, `loadtest`):
    every `--flag VALUE` and `--[no-]flag` not in `skip` (dest names) takes its default from
    `<prefix><FLAG>` when set, checked as add_arguments checks a service's, and says so in --help.
    Plain switches (store_true) and repeatable flags are left alone: a switch the environment turned
    on could not be turned off again by a flag."""
    env = os.environ if env is None else env
    errors = []
    for action in parser._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        boolean = isinstance(action, argparse.BooleanOptionalAction)
        single = type(action) is argparse._StoreAction and action.nargs in (None, "?")  # one value, not a list
        if not long or action.dest in skip or not (boolean or single):
            continue
        name = env_name(prefix, long[0][2:].replace("-", "_"))
        if name in env:
            try:
                action.default = env_value(name, env[name], bool if boolean else (action.type or str), action.choices)
            except ValueError as exc:
                errors.append(str(exc))
        if name not in (action.help or ""):
            action.help = f"{action.help or ''} [env {name}]".lstrip()
    if errors:
        parser.error("; ".join(errors))


def from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    return cls(**{field.name: getattr(namespace, field.name) for field in dataclasses.fields(cls)})


def from_argv(cls: type[T], argv: Sequence[str] | None, env_prefix: str, prog: str, env: Mapping[str, str] | None = None,
              version: str | None = None) -> T:
    """The config from flags, then the environment, then the defaults. Anything wrong with them (a
    value outside a flag's choices, an unparsable number, a check of the config's own) is a usage
    error: exit status 2 and one line naming the flag or variable, as argparse reports its own."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    if version is not None:
        parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    add_arguments(parser, cls, env_prefix, os.environ if env is None else env)
    namespace = parser.parse_args(argv)
    try:
        return from_namespace(cls, namespace)
    except ValueError as exc:  # __post_init__'s checks name the flag
        parser.error(str(exc))


def markdown_table(cls: type, env_prefix: str) -> str:
    """The configuration table docs/configuration.md shows, generated so that it cannot drift from the code."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        rows.append(f"| `{flag}` | `{env_name(env_prefix, field.name)}` | `{field.default!r}` | {field.metadata.get('help', '')} |")
    return "\n".join(rows)
