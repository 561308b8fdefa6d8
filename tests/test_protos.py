"""The committed stubs are exactly what `python -m specdec.protogen` makes from the .proto."""

import pathlib
import shutil
import subprocess
import sys

import pytest

from specdec import protogen

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto(tmp_path):
    for path in protogen.generate(tmp_path):
        committed = REPO / "protos" / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run python -m specdec.protogen"


def test_buf_lint_is_clean():
    buf = str(pathlib.Path(sys.executable).parent / "buf")
    if not pathlib.Path(buf).exists():
        buf = shutil.which("buf") or buf
    if not pathlib.Path(buf).exists():
        pytest.skip("buf is not installed (pip install buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
