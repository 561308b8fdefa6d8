"""The committed stubs are exactly what `python -m specdec_tools.protogen` makes from the .proto."""

import pathlib
import shutil
import subprocess
import sys

import pytest

from specdec_tools import protogen

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto(tmp_path):
    for path in protogen.generate(tmp_path):
        committed = REPO / "protos" / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run python -m specdec_tools.protogen"


def _buf() -> str:
    buf = pathlib.Path(sys.executable).parent / "buf"
    found = str(buf) if buf.exists() else shutil.which("buf")
    if not found:
        pytest.skip("buf is not installed (pip install buf-bin)")
    return found


def test_buf_lint_is_clean():
    result = subprocess.run([_buf(), "lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_breaking_change_against_the_last_release():
    released = sorted((REPO / "protos" / "released").glob("v*.binpb"), key=lambda p: [int(x) for x in p.stem[1:].split(".")])
    assert released, "no released contract image in protos/released"
    result = subprocess.run([_buf(), "breaking", "--against", str(released[-1])], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"breaking change against {released[-1].name}:\n" + result.stdout + result.stderr
