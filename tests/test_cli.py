"""The `specdec` command's own behaviour: --version, usage errors instead of tracebacks for bad flags
and environment variables, SPECDEC_<FLAG> defaults for the tools, renamed flags, help that points at
files that exist, and default output folders that never overwrite committed results."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from specdec.version import package_version
from specdec_tools import bench, cli, flags, loadtest

REPO = pathlib.Path(__file__).resolve().parent.parent


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec_tools.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, **(env or {})})


def test_version_from_the_package_metadata_or_pyproject():
    in_pyproject = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert package_version() == in_pyproject  # the installed metadata and the checkout agree
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"specdec {in_pyproject}"
    done = run_cli("serve", "draft", "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"specdec serve draft {in_pyproject}"


@pytest.mark.parametrize("command", ["up", "generate", "bench", "loadtest", "plan", "distill"])
def test_every_tool_has_version(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"specdec {command} {package_version()}"


# (argv, environment, what the one-line message must say)
BAD = [
    (["serve", "draft", "--log-level", "loud"], {}, "argument --log-level: invalid choice: 'loud'"),
    (["serve", "draft"], {"SPECDEC_DRAFT_LOG_FORMAT": "xml"}, "SPECDEC_DRAFT_LOG_FORMAT='xml': must be one of auto, json, console"),
    (["serve", "target"], {"SPECDEC_TARGET_LOG_LEVEL": "LOUD"}, "SPECDEC_TARGET_LOG_LEVEL='LOUD': must be one of debug, info, warning, error"),
    (["serve", "coordinator"], {"SPECDEC_COORDINATOR_OVERLAP": "sometimes"}, "SPECDEC_COORDINATOR_OVERLAP='sometimes': must be one of off, auto, on"),
    (["serve", "coordinator"], {"SPECDEC_COORDINATOR_PORT": "80x"}, "SPECDEC_COORDINATOR_PORT='80x': must be an integer"),
    (["serve", "coordinator"], {"SPECDEC_COORDINATOR_RPC_TIMEOUT_S": "soon"}, "SPECDEC_COORDINATOR_RPC_TIMEOUT_S='soon': must be a number"),
    (["serve", "coordinator"], {"SPECDEC_COORDINATOR_ADAPTIVE": "perhaps"}, "SPECDEC_COORDINATOR_ADAPTIVE='perhaps': must be a boolean"),
    (["serve", "coordinator", "--tree-budget", "1000"], {}, "--tree-budget must be in [0, 64], got 1000"),
    (["up"], {"SPECDEC_DRAFTER": "gpt"}, "SPECDEC_DRAFTER='gpt': must be one of auto, ngram, model"),
    (["generate", "hi"], {"SPECDEC_MAX_NEW_TOKENS": "many"}, "SPECDEC_MAX_NEW_TOKENS='many': must be an integer"),
    (["loadtest"], {"SPECDEC_SPECULATION": "maybe"}, "SPECDEC_SPECULATION='maybe': must be one of on, off, both"),
    (["bench"], {"SPECDEC_REPEATS": "2.5"}, "SPECDEC_REPEATS='2.5': must be an integer"),
]


@pytest.mark.parametrize(("argv", "env", "message"), BAD, ids=[" ".join(a) + " " + " ".join(e) for a, e, _ in BAD])
def test_bad_flags_and_environment_are_usage_errors(argv, env, message, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"specdec {argv[0]}") and message in last


def test_a_bad_environment_variable_is_one_line_from_the_real_command():
    """As a process: exit status 2, argparse's usage and one error line, no traceback."""
    done = run_cli("serve", "draft", env={"SPECDEC_DRAFT_LOG_FORMAT": "xml"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "specdec serve draft: error: SPECDEC_DRAFT_LOG_FORMAT='xml': must be one of auto, json, console"
    assert "--log-level {debug,info,warning,error}" in done.stderr  # the whole usage, not the flags added before the error


def test_tools_take_specdec_flag_defaults_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_MAX_NEW_TOKENS", "7")
    monkeypatch.setenv("SPECDEC_CHECK", "off")
    monkeypatch.setenv("SPECDEC_TARGET_MODEL", "some-model")
    args = loadtest.parse([])
    assert (args.max_new_tokens, args.check, args.target_model) == (7, False, "some-model")
    assert loadtest.parse(["--max-new-tokens", "9", "--check"]).max_new_tokens == 9  # flags win
    assert bench.parse([]).target == "some-model"
    with pytest.raises(SystemExit):
        loadtest.parse(["--help"])
    assert "[env SPECDEC_MAX_NEW_TOKENS]" in " ".join(capsys.readouterr().out.split())


def test_help_never_prints_a_token_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_COORDINATOR_API_TOKEN", "s3cret-token")
    with pytest.raises(SystemExit):
        cli.main(["serve", "coordinator", "--help"])
    assert "s3cret-token" not in capsys.readouterr().out


def test_target_model_flags_and_the_old_name_warns_once(capsys):
    """--target is an address in `specdec serve coordinator`; the tools that take a model call it --target-model."""
    from specdec_tools import distill

    assert bench.parse(["--target-model", "a"]).target == "a"
    assert bench.parse(["--target", "b", "--target", "c"]).target == "c"
    assert capsys.readouterr().err.count("--target is deprecated, use --target-model") == 1
    assert distill.parse_args(["--target", "d", "--out", "o"]).target == "d"
    assert "specdec distill: warning: --target is deprecated" in capsys.readouterr().err


def test_results_folders_are_not_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_OUT", "shared")
    assert loadtest.parse([]).out != "shared" and str(bench.parse([]).out) != "shared"


def test_default_outputs_are_fresh_folders_never_the_committed_results(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    outs = [str(bench.parse([]).out), loadtest.parse([]).out, flags.fresh_out("loadtest")]
    assert all(out.startswith(flags.RESULTS_ROOT + "/") for out in outs) and len(set(outs[1:])) == 1  # same second, not created
    pathlib.Path(outs[1]).mkdir(parents=True)
    assert flags.fresh_out("loadtest") != outs[1]  # one that exists is not reused
    assert str(bench.parse(["--out", "x"]).out) == "x" and loadtest.parse(["--out", "y"]).out == "y"
    assert f"/{flags.RESULTS_ROOT}/" in (REPO / ".gitignore").read_text()


@pytest.mark.parametrize("command", ["up", "generate", "bench", "loadtest", "plan", "distill"])
def test_help_names_only_files_that_exist(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in re.findall(r"[\w./-]+\.md\b", text):
        assert (REPO / name).is_file(), f"`specdec {command} --help` names {name}, which is not in the repository"
    for folder in re.findall(r"specdec/drafts/[\w.-]+", text):
        assert (REPO / folder).is_dir() or "none is committed" in text, f"`specdec {command} --help` names {folder}"
