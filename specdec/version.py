"""The package's version, for `specdec --version` and every service's `--version`."""

from __future__ import annotations

import pathlib
import re

DISTRIBUTION = "specdec"


def package_version() -> str:
    """The installed distribution's version; in a checkout run without installing it, pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        return "unknown"
    project = text.split("[project]", 1)[-1].split("\n[", 1)[0]  # the [project] table alone
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    return match.group(1) if match else "unknown"
