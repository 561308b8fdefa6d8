"""`specdec generate` and `specdec loadtest --address` against a coordinator that requires an API
token and serves TLS (and one that requires client certificates: mutual TLS).

Real coordinators on loopback with tiny models, certificates made by scripts/make_dev_certs.sh
(openssl) for 127.0.0.1 and localhost. The right token over TLS must give exactly what a plaintext
coordinator on the same backends gives; a wrong or missing token, plaintext against TLS, an
unknown CA or a missing client certificate must each end in one clear line and a non-zero exit,
quickly and without a traceback. The Node and Java clients' cases are in tests/test_clients.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import types

import pytest

from protos import specdec_pb2 as pb
from specdec_tools import connect, loadtest
from tests import tiny
from tests.stack import Stack

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token"
PROMPT = "Once upon"
MAX_NEW = 8


def make_certs(folder: pathlib.Path) -> pathlib.Path:
    """A CA, a server certificate for 127.0.0.1/localhost/coordinator and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make test certificates)")
    subprocess.run(["bash", str(REPO / "scripts" / "make_dev_certs.sh"), str(folder)], check=True, capture_output=True, timeout=60)
    return folder


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-auth")
    certs, other = make_certs(root / "certs"), make_certs(root / "other")  # `other`: a CA the servers do not know
    target, draft = tiny.tiny_pair(seed=0)
    stack = Stack()
    try:
        target_dir = tiny.save(target, root / "target")
        target_addr = stack.target(target_dir)
        draft_addr = stack.draft(drafter="model", model=tiny.save(draft, root / "draft"))
        server = dict(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"))
        plain = stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer())  # the reference: no token, no TLS
        yield types.SimpleNamespace(
            certs=certs, other=other, target_dir=target_dir, plain_address=plain, plain=stack.client(plain),
            tls=stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer(), api_token=TOKEN, **server),
            mtls=stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer(), api_token=TOKEN, tls_ca=str(certs / "ca.pem"), **server),
        )
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def expected(secure) -> pb.GenerateResponse:
    return secure.plain.Generate(pb.GenerateRequest(text=PROMPT, max_new_tokens=MAX_NEW), timeout=60)


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, seconds: float):
        self.code, self.stdout, self.stderr, self.seconds = proc.returncode, proc.stdout, proc.stderr, seconds

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def __repr__(self) -> str:
        return f"exit {self.code} after {self.seconds:.1f}s\n--- stdout\n{self.stdout!r}\n--- stderr\n{self.stderr}"


def generate(address: str, *flags: str, env: dict[str, str] | None = None) -> Run:
    environ = {k: v for k, v in os.environ.items() if k != connect.ENV_TOKEN}
    environ.update(PYTHONIOENCODING="utf-8", **(env or {}))
    command = [sys.executable, "-m", "specdec_tools.cli", "generate", "--raw", "--max-new-tokens", str(MAX_NEW),
               "--address", address, "--wait", "20", *flags, PROMPT]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", timeout=120, env=environ, cwd=REPO)
    return Run(proc, time.monotonic() - start)


def assert_generated(result: Run, expected: pb.GenerateResponse) -> None:
    assert result.code == 0, result
    assert result.stdout == expected.text + "\n", result  # the very text a plaintext, open coordinator gives
    assert result.last_line.startswith(f"[length] {MAX_NEW} tokens"), result


def assert_refused(result: Run, *needles: str) -> None:
    """Exit 1 with one clear line: no traceback, nothing on stdout, each needle in the last line."""
    assert result.code == 1, result
    assert "Traceback" not in result.stderr and result.stdout.strip() == "", result
    assert result.last_line.startswith("specdec generate: "), result
    for needle in needles:
        assert needle in result.last_line, result
    assert result.seconds < 15, result  # at once, not after --wait (20 s)


def test_token_and_tls(secure, expected):
    assert_generated(generate(secure.tls, "--api-token", TOKEN, "--tls-ca", str(secure.certs / "ca.pem")), expected)


def test_token_from_the_environment_and_mutual_tls(secure, expected):
    certs = secure.certs
    result = generate(secure.mtls, "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "client.pem"),
                      "--tls-key", str(certs / "client.key"), env={connect.ENV_TOKEN: TOKEN})
    assert_generated(result, expected)


def test_server_name_override(secure, expected):
    """The certificate names `coordinator` too: expected instead of the address's 127.0.0.1, and checked."""
    ca = str(secure.certs / "ca.pem")
    assert_generated(generate(secure.tls, "--api-token", TOKEN, "--tls-ca", ca, "--tls-server-name", "coordinator"), expected)
    assert_refused(generate(secure.tls, "--api-token", TOKEN, "--tls-ca", ca, "--tls-server-name", "elsewhere"),
                   "UNAVAILABLE", "--tls-server-name")


def test_wrong_token(secure):
    result = generate(secure.tls, "--api-token", "not-the-token", "--tls-ca", str(secure.certs / "ca.pem"))
    assert_refused(result, "PERMISSION_DENIED", "invalid bearer token", "--api-token")
    assert "not-the-token" not in result.stderr and TOKEN not in result.stderr


def test_missing_token(secure):
    assert_refused(generate(secure.tls, "--tls-ca", str(secure.certs / "ca.pem")), "UNAUTHENTICATED", "--api-token", connect.ENV_TOKEN)


def test_plaintext_against_tls(secure):
    assert_refused(generate(secure.tls, "--api-token", TOKEN), "cannot connect", "--tls-ca")


def test_unknown_ca(secure):
    assert_refused(generate(secure.tls, "--api-token", TOKEN, "--tls-ca", str(secure.other / "ca.pem")),
                   "cannot connect", "CERTIFICATE_VERIFY_FAILED", "--tls-ca")


def test_mutual_tls_without_a_client_certificate(secure):
    assert_refused(generate(secure.mtls, "--api-token", TOKEN, "--tls-ca", str(secure.certs / "ca.pem")), "cannot connect", "--tls-cert")


def test_client_certificate_of_another_ca(secure):
    other = secure.other
    result = generate(secure.mtls, "--api-token", TOKEN, "--tls-ca", str(secure.certs / "ca.pem"),
                      "--tls-cert", str(other / "client.pem"), "--tls-key", str(other / "client.key"))
    assert_refused(result, "cannot connect", "--tls-cert")


def test_tls_against_plaintext(secure):
    assert_refused(generate(secure.plain_address, "--tls-ca", str(secure.certs / "ca.pem")), "cannot connect", "does not speak TLS")


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: cannot read"),
    (["--api-token", "two words"], "--api-token"),
])
def test_bad_connection_flags_exit_2(flags, message):
    result = generate("127.0.0.1:1", *flags)
    assert result.code == 2 and message in result.stderr and "Traceback" not in result.stderr, result


# --- specdec loadtest --address ---------------------------------------------------------------------

def loadtest_argv(secure, out: pathlib.Path, *flags: str) -> list[str]:
    return ["--address", secure.tls, "--tls-ca", str(secure.certs / "ca.pem"), "--target-model", secure.target_dir,
            "--prompts", "chat", "--max-prompts", "2", "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
            "--max-new-tokens", "6", "--speculation", "on", "--out", str(out), *flags]


def test_loadtest_with_token_and_tls(secure, tmp_path, monkeypatch):
    monkeypatch.delenv(connect.ENV_TOKEN, raising=False)
    assert loadtest.main(loadtest_argv(secure, tmp_path, "--api-token", TOKEN)) == 0
    report = json.loads((tmp_path / "loadtest.json").read_text())
    (run,) = report["runs"]
    assert run["failed"] == 0 and run["completed"] == run["identical"] == 4, run
    assert TOKEN not in (tmp_path / "loadtest.json").read_text()  # the token stays out of the report


@pytest.mark.parametrize("token, code", [("wrong", "PERMISSION_DENIED"), ("", "UNAUTHENTICATED")])
def test_loadtest_refused_token_is_one_clear_line(secure, tmp_path, monkeypatch, capsys, token, code):
    monkeypatch.delenv(connect.ENV_TOKEN, raising=False)
    assert loadtest.main(loadtest_argv(secure, tmp_path, "--api-token", token)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"specdec loadtest: every request was refused: {code}") and "--api-token" in err[-1], err


def test_loadtest_plaintext_against_tls_is_one_clear_line(secure, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(connect.ENV_TOKEN, raising=False)
    argv = [a for a in loadtest_argv(secure, tmp_path, "--api-token", TOKEN) if a != str(secure.certs / "ca.pem") and a != "--tls-ca"]
    assert loadtest.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specdec loadtest: cannot connect to the coordinator") and "--tls-ca" in err[-1], err
