"""The OpenAI-compatible HTTP API (with the official `openai` client), /metrics, and the API token."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests import tiny
from tests.stack import Stack

TOKEN = "test-token"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    stack = Stack()
    grpc_addr, base, target = stack.tiny_speculative(tmp_path_factory.mktemp("tiny-http"), api_token=TOKEN, served_model_name="tiny")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    yield {"base": base, "client": client, "grpc": grpc_addr, "target": target, "stack": stack}
    stack.stop()


def scrape(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_completions_greedy_match_the_target_alone(env):
    prompt = "The quick brown fox"
    ids = tiny.byte_tokenizer()(prompt, add_special_tokens=False)["input_ids"]
    expected = tiny.reference_greedy(env["target"], ids, 12)
    result = env["client"].completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert result.choices[0].text == tiny.byte_tokenizer().decode(expected, skip_special_tokens=True)
    assert result.usage.completion_tokens == len(expected) and result.usage.prompt_tokens == len(ids)
    assert result.choices[0].finish_reason in ("length", "stop")
    extra = result.model_extra["speculation"]
    assert extra["steps"] >= 1 and 0 <= extra["acceptance_rate"] <= 1
    assert 1 <= extra["first_step_tokens"] <= result.usage.completion_tokens


def test_completions_stream_equals_non_stream(env):
    kwargs = dict(model="tiny", prompt=[5, 6, 7, 8], max_tokens=16, temperature=0)
    whole = env["client"].completions.create(**kwargs).choices[0].text
    chunks = list(env["client"].completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_completions_stream_and_not(env):
    messages = [{"role": "user", "content": "hello"}]
    whole = env["client"].chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = list(env["client"].chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sse_ends_with_done(env):
    request = urllib.request.Request(f"{env['base']}/v1/chat/completions", method="POST",
                                     data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}).encode(),
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    body = urllib.request.urlopen(request, timeout=30).read().decode()
    events = [line for line in body.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_models_and_health(env):
    assert [m.id for m in env["client"].models.list().data]
    assert json.loads(urllib.request.urlopen(f"{env['base']}/health", timeout=10).read())["status"] == "ok"


def test_health_and_new_requests_answer_503_while_draining(env):
    """SIGTERM flips the gRPC server's Drain; HTTP must agree, or a load balancer keeps sending here."""
    drain = env["stack"].servers[-1].drain
    drain.draining = True
    try:
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{env['base']}/health", timeout=10)
        assert health.value.code == 503 and json.loads(health.value.read())["status"] == "draining"
        with pytest.raises(openai.APIStatusError) as call:
            env["client"].completions.create(model="m", prompt="hi", max_tokens=2)
        assert call.value.status_code == 503
    finally:
        drain.draining = False
    assert json.loads(urllib.request.urlopen(f"{env['base']}/health", timeout=10).read())["status"] == "ok"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
])
def test_bad_requests_get_400_naming_the_field(env, body, param):
    request = urllib.request.Request(f"{env['base']}/v1/completions", method="POST", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]
    assert error["param"] == param and error["message"].startswith(param)


def test_token_is_required_on_both_apis_but_not_for_health(env):
    bad = openai.OpenAI(base_url=f"{env['base']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        bad.models.list()
    with pytest.raises(urllib.error.HTTPError) as non_ascii:  # was a 500: str comparison of non-ASCII characters
        urllib.request.urlopen(urllib.request.Request(f"{env['base']}/v1/models", headers={"Authorization": "Bearer t\u00f6ken"}),
                               timeout=10)
    assert non_ascii.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{env['base']}/v1/models", timeout=10)
    assert info.value.code == 401
    channel = grpc.insecure_channel(env["grpc"])
    stub = env["stack"].client(env["grpc"])
    request = pb.GenerateRequest(text="hi", max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as missing:
        stub.Generate(request, timeout=10)
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as wrong:
        list(stub.GenerateStream(pb.GenerateStreamRequest(text="hi", max_new_tokens=2), timeout=10, metadata=[("authorization", "Bearer nope")]))
    assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
    ok = stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")])
    assert ok.stats.completion_tokens == 2
    # the scheme's name is case-insensitive (RFC 7235): lower-case `bearer` is the same credential
    assert stub.Generate(request, timeout=30, metadata=[("authorization", f"bearer {TOKEN}")]).stats.completion_tokens == 2
    lower = urllib.request.Request(f"{env['base']}/v1/models", headers={"Authorization": f"bearer {TOKEN}"})
    assert urllib.request.urlopen(lower, timeout=10).status == 200
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_metrics_counters_match_response_statistics(env):
    before = scrape(env["base"])
    stub = env["stack"].client(env["grpc"])
    totals = {"steps": 0, "draft": 0, "accepted": 0, "tokens": 0, "pos0": 0}
    for prompt in tiny.prompts(4, seed=3):
        stats = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=16), timeout=60,
                              metadata=[("authorization", f"Bearer {TOKEN}")]).stats
        totals["steps"] += stats.steps
        totals["draft"] += stats.draft_tokens
        totals["accepted"] += stats.accepted_tokens
        totals["tokens"] += stats.completion_tokens
        totals["pos0"] += stats.accepted_per_position[0] if stats.accepted_per_position else 0
    after = scrape(env["base"])

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    def ours(name, **labels):  # the coordinator's request metrics carry the model it serves; exposed sorted
        labels["model_name"] = "tiny"  # the fixture's --served-model-name
        return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"

    assert delta(ours("specdec:spec_decode_num_steps_total")) == totals["steps"]
    assert delta(ours("specdec:spec_decode_num_draft_tokens_total")) == totals["draft"] > 0
    assert delta(ours("specdec:spec_decode_num_accepted_tokens_total")) == totals["accepted"]
    assert delta(ours("specdec:generation_tokens_total")) == totals["tokens"]
    assert delta(ours("specdec:spec_decode_num_accepted_tokens_per_pos_total", position=0)) == totals["pos0"]
    assert delta(ours("specdec:request_success_total", finished_reason="length")) + delta(ours("specdec:request_success_total", finished_reason="eos")) == 4
    # The target's own counters (same process in this test) saw the same draft tokens.
    assert delta("specdec:target_spec_decode_num_draft_tokens_total") == totals["draft"]
    assert any(re.match(r"specdec:time_to_first_token_seconds_count", k) for k in after)


def test_mutual_tls_between_coordinator_and_backends(tmp_path):
    """Draft and target demand client certificates; the coordinator presents one; others are refused."""
    certs = tmp_path / "certs"
    subprocess.run(["bash", "scripts/make_dev_certs.sh", str(certs)], check=True, capture_output=True,
                   cwd=pathlib.Path(__file__).resolve().parent.parent)
    server_tls = dict(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"), tls_ca=str(certs / "ca.pem"))
    target, draft = tiny.tiny_pair(seed=1)
    stack = Stack()
    try:
        target_addr = stack.target(tiny.save(target, tmp_path / "t"), host="localhost", **server_tls).replace("127.0.0.1", "localhost")
        draft_addr = stack.draft(drafter="model", model=tiny.save(draft, tmp_path / "d"), host="localhost", **server_tls).replace("127.0.0.1", "localhost")
        coordinator = stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer(), backend_tls_ca=str(certs / "ca.pem"),
                                        backend_tls_cert=str(certs / "client.pem"), backend_tls_key=str(certs / "client.key"))
        response = stack.client(coordinator).Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=6), timeout=60)
        assert list(response.token_ids) == tiny.reference_greedy(target, [1, 2, 3], 6)
        # Plaintext, and TLS without a client certificate, are both refused by the target.
        for channel in (grpc.insecure_channel(target_addr),
                        grpc.secure_channel(target_addr, grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes()))):
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.TargetServiceStub(channel).GetInfo(pb.TargetServiceGetInfoRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            channel.close()
    finally:
        stack.stop()
