"""ruff (pyflakes + bugbear) over the project: unused names and likely bugs fail CI."""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    ruff = pathlib.Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed (pip install -e .[dev])")
    result = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
