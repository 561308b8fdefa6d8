"""The layer rule, enforced: imports only go down (protos < specdec < draft_service | target_service
< coordinator < specdec_tools), as pyproject.toml's import-linter contracts say. The second test
shows the check has teeth: one upward import, added to a copy of the code, breaks it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ["protos", "specdec", "draft_service", "target_service", "coordinator", "specdec_tools"]


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(lint), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_imports_only_go_down():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_breaks_the_contract(tmp_path):
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("*.c", "drafts", "prompts", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    engine = tmp_path / "target_service" / "engine.py"
    engine.write_text(engine.read_text() + "\nfrom coordinator.loop import SpeculativeLoop  # noqa: E402,F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "target_service.engine -> coordinator.loop" in result.stdout
