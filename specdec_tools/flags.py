"""What every tool's parser shares with `specdec serve`: `--version`, defaults from `SPECDEC_<FLAG>`
environment variables (specdec.serving.config.env_defaults, the services' own mechanism), and
renamed flags that keep working for a while.

    parser = argparse.ArgumentParser(prog="specdec up", ...)
    ...                                            # the tool's own flags
    flags.deprecated_alias(parser, "--target", "target_model", "--target-model")
    flags.finish(parser)                           # --version, then SPECDEC_<FLAG> defaults
    args = parser.parse_args(argv)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdec.serving.config import env_defaults
from specdec.version import package_version

ENV_PREFIX = "SPECDEC_"


# Never from the environment: a results folder belongs to one run, and `bench`, `loadtest` and
# `distill` would all write into the one a shared SPECDEC_OUT named.
NOT_FROM_ENV = ("out",)


def finish(parser: argparse.ArgumentParser, skip: Sequence[str] = (), env: bool = True) -> None:
    """Adds --version and (`env`) gives the flags but NOT_FROM_ENV and `skip` (dests) their
    SPECDEC_<FLAG> defaults. Call it after the last add_argument: flags added later read no environment."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    if env:
        env_defaults(parser, ENV_PREFIX, skip=(*NOT_FROM_ENV, *skip))


class _Renamed(argparse.Action):
    """The old name of a renamed flag: stores into the new flag's dest and says, once, to use the new name."""

    def __init__(self, option_strings, dest, new_flag: str = "", **kwargs):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if not getattr(parser, "_warned_renamed", False):
            print(f"{parser.prog}: warning: {option_string} is deprecated, use {self.new_flag}", file=sys.stderr)
            parser._warned_renamed = True
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old_flag: str, dest: str, new_flag: str) -> None:
    """`old_flag VALUE` keeps working as `new_flag VALUE` (same dest), with a warning, and --help says so."""
    parser.add_argument(old_flag, dest=dest, action=_Renamed, new_flag=new_flag, default=argparse.SUPPRESS,
                        help=f"Deprecated name of {new_flag}.")


RESULTS_ROOT = "bench-results"  # ignored by git: a run's numbers are committed by choice, with --out


def fresh_out(kind: str) -> str:
    """The default --out of `specdec bench` and `loadtest`: a new folder for each run, so a run never
    overwrites results someone committed (those live under benchmarks/results/, written with --out)."""
    import pathlib
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = pathlib.Path(RESULTS_ROOT) / f"{kind}-{stamp}"
    n = 1
    while folder.exists():  # two runs within a second
        n += 1
        folder = pathlib.Path(RESULTS_ROOT) / f"{kind}-{stamp}-{n}"
    return str(folder)
