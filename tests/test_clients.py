"""The Node and Java command-line clients (clients/) against a live local stack with tiny models.

Each CLI streams GenerateStream; its output must be what the Python client gets from Generate for
the same request: the same tokens (the target's own greedy generate()), the same text, the same
counts. The clients are installed and built by scripts/setup_clients.sh; without it these skip.

Coordinators on the same backends that require an API token and serve TLS (one of them mutual TLS,
certificates from scripts/make_dev_certs.sh) check the clients' --api-token/$SPECDEC_API_TOKEN and
--tls-* flags: the same output with the right ones, exit 1 and the status name without them.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

from protos import specdec_pb2 as pb
from tests import tiny
from tests.stack import Stack

REPO = pathlib.Path(__file__).resolve().parents[1]
NODE_DIR = REPO / "clients" / "node"
JAVA_DIR = REPO / "clients" / "java"
MAX_NEW = 16
TOKEN = "client-token"
TOKEN_ENV = "SPECDEC_API_TOKEN"
SETUP_HINT = "run `bash scripts/setup_clients.sh` (as root) to install and build the clients"


def node_command() -> list[str]:
    if shutil.which("node") is None:
        pytest.skip(f"node is not installed; {SETUP_HINT}")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip(f"clients/node/node_modules is missing (npm ci); {SETUP_HINT}")
    return ["node", str(NODE_DIR / "generate.js")]


def java_command() -> list[str]:
    missing = [tool for tool in ("java", "javac") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed; {SETUP_HINT}")
    if not (JAVA_DIR / "build" / "classpath").is_file():
        pytest.skip(f"clients/java/build is missing (clients/java/build.sh); {SETUP_HINT}")
    return ["bash", str(JAVA_DIR / "run.sh")]


COMMANDS = {"node": node_command, "java": java_command}


@pytest.fixture(params=sorted(COMMANDS))
def cli(request) -> list[str]:
    # Requested before `env`, so a missing client skips without starting the stack.
    return COMMANDS[request.param]()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target, draft = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("tiny-clients")
    stack = Stack()
    try:
        target_addr = stack.target(tiny.save(target, folder / "target"))
        draft_addr = stack.draft(drafter="model", model=tiny.save(draft, folder / "draft"))
        address = stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer())
        yield {"target": target, "address": address, "client": stack.client(address), "stack": stack,
               "backends": (target_addr, draft_addr)}
    finally:
        stack.stop()


class Run:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.code = proc.returncode
        # Bytes decoded strictly: text mode would also fold "\r" into "\n".
        self.stdout = proc.stdout.decode("utf-8")
        self.stderr = proc.stderr.decode("utf-8")

    def summary(self) -> dict:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        assert lines, "nothing on stderr"
        return json.loads(lines[-1])

    def __repr__(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.stdout!r}\n--- stderr\n{self.stderr}"


@pytest.fixture(scope="module")
def secure(env, tmp_path_factory) -> dict:
    """Coordinators on env's backends requiring TOKEN: one over TLS, one over mutual TLS."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make test certificates)")
    certs = tmp_path_factory.mktemp("client-certs")
    subprocess.run(["bash", str(REPO / "scripts" / "make_dev_certs.sh"), str(certs)], check=True, capture_output=True, timeout=60)
    server = dict(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"), api_token=TOKEN)
    coordinator = lambda **tls: env["stack"].coordinator(*env["backends"], tiny.byte_tokenizer(), **server, **tls)  # noqa: E731
    return {"certs": certs, "tls": coordinator(), "mtls": coordinator(tls_ca=str(certs / "ca.pem"))}


def run(cli: list[str], address: str, *args: str, env: dict[str, str] | None = None) -> Run:
    # The POSIX locale, as a bare CI shell may have: the clients must read and write UTF-8 anyway.
    # No API token from this shell: each test passes its own.
    environ = {k: v for k, v in os.environ.items() if k not in ("LANG", TOKEN_ENV) and not k.startswith("LC_")}
    environ.update(env or {})
    proc = subprocess.run([*cli, "--address", address, "--timeout", "60", *args],
                          capture_output=True, timeout=90, env=environ, cwd=REPO)
    return Run(proc)


STATS_FIELDS = [field.name for field in pb.GenerationStats.DESCRIPTOR.fields]


def check_against_unary(result: Run, unary: pb.GenerateResponse, prompt_tokens: int) -> dict:
    assert result.code == 0, result
    summary = result.summary()
    assert summary["token_ids"] == list(unary.token_ids), result
    assert result.stdout == unary.text, result
    assert summary["finish_reason"] == pb.FinishReason.Name(unary.finish_reason)
    stats = summary["stats"]
    assert list(stats) == STATS_FIELDS  # every field, named as in the proto, in its order
    assert stats["completion_tokens"] == unary.stats.completion_tokens == len(unary.token_ids)
    assert stats["prompt_tokens"] == prompt_tokens
    assert stats["steps"] >= 1 and stats["total_seconds"] > 0 and stats["wire_bytes"] > 0
    assert stats["accepted_tokens"] <= stats["draft_tokens"]
    assert len(stats["accepted_per_position"]) >= 0 and 0 <= stats["acceptance_rate"] <= 1
    return summary


@pytest.mark.parametrize("index", [3, 7])
def test_token_id_prompt_greedy_matches_python_client_and_target(cli, env, index):
    prompt = tiny.prompts()[index]
    unary = env["client"].Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW), timeout=60)
    assert list(unary.token_ids) == tiny.reference_greedy(env["target"], prompt, MAX_NEW)
    result = run(cli, env["address"], "--token-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--draft-length", "4")
    summary = check_against_unary(result, unary, len(prompt))
    assert summary["stats"]["draft_tokens"] > 0  # speculation really happened


def test_text_prompt_with_non_ascii_and_seeded_sampling(cli, env):
    prompt = "Grüße, ✓ speculative"
    sampling = pb.SamplingParams(temperature=0.8, seed=12345)
    unary = env["client"].Generate(
        pb.GenerateRequest(text=prompt, max_new_tokens=MAX_NEW, sampling=sampling), timeout=60)
    result = run(cli, env["address"], "--max-new-tokens", str(MAX_NEW), "--temperature", "0.8",
                 "--seed", "12345", prompt)
    check_against_unary(result, unary, len(prompt.encode("utf-8")))


def test_bad_request_exits_1_with_invalid_argument(cli, env):
    result = run(cli, env["address"], "--token-ids", "1,2,3", "--max-new-tokens", "-1")
    assert result.code == 1, result
    assert "INVALID_ARGUMENT" in result.stderr and "max_new_tokens" in result.stderr, result
    assert result.stdout == ""


def test_usage_error_exits_2(cli):
    result = run(cli, "127.0.0.1:1", "--token-ids", "1,x")
    assert result.code == 2, result
    assert "usage:" in result.stderr


def greedy_unary(env, index: int) -> tuple[list[int], pb.GenerateResponse]:
    prompt = tiny.prompts()[index]
    unary = env["client"].Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW), timeout=60)
    return prompt, unary


def test_token_and_tls_match_the_python_client(cli, env, secure):
    prompt, unary = greedy_unary(env, 5)
    result = run(cli, secure["tls"], "--api-token", TOKEN, "--tls-ca", str(secure["certs"] / "ca.pem"),
                 "--token-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(MAX_NEW))
    check_against_unary(result, unary, len(prompt))
    assert len(result.stderr.splitlines()) == 1, result  # the summary only: no warning about TLS to an IP address


def test_mutual_tls_with_the_token_from_the_environment(cli, env, secure):
    """A client certificate, $SPECDEC_API_TOKEN, and a server name other than the address's host."""
    certs = secure["certs"]
    prompt, unary = greedy_unary(env, 9)
    result = run(cli, secure["mtls"], "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "client.pem"),
                 "--tls-key", str(certs / "client.key"), "--tls-server-name", "coordinator",
                 "--token-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(MAX_NEW), env={TOKEN_ENV: TOKEN})
    check_against_unary(result, unary, len(prompt))


@pytest.mark.parametrize("token, status", [("wrong-token", "PERMISSION_DENIED"), (None, "UNAUTHENTICATED")])
def test_refused_token_exits_1_with_the_status(cli, secure, token, status):
    flags = ["--api-token", token] if token else []
    result = run(cli, secure["tls"], *flags, "--tls-ca", str(secure["certs"] / "ca.pem"), "--token-ids", "1,2,3")
    assert result.code == 1, result
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{status}: ") and "--api-token" in last, result
    assert result.stdout == ""


@pytest.mark.parametrize("case", ["plaintext", "no client certificate"])
def test_tls_mismatch_exits_1_unavailable(cli, secure, case):
    address, flags = (secure["tls"], []) if case == "plaintext" else (secure["mtls"], ["--tls-ca", str(secure["certs"] / "ca.pem")])
    result = run(cli, address, "--api-token", TOKEN, *flags, "--token-ids", "1,2,3")
    assert result.code == 1, result
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("UNAVAILABLE: ") and "--tls-c" in last, result  # with a hint: --tls-ca or --tls-cert
    assert result.stdout == ""


@pytest.mark.parametrize("flags", [["--tls-cert", "client.pem"], ["--tls-ca", "/nonexistent/ca.pem"]])
def test_bad_tls_flags_exit_2(cli, flags):
    result = run(cli, "127.0.0.1:1", *flags, "--token-ids", "1")
    assert result.code == 2, result
    assert "usage:" in result.stderr and flags[0] in result.stderr, result
