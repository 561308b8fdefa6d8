"""`--backend-token`: a draft and a target that require it, and every client of theirs sending it.

Real services on loopback with tests.tiny's randomly initialised target and noisy draft. The draft is
the target's --draft, so a drafted run's proposals travel the target's own Drafts stream; two
coordinators drive them, one with runs (coordinator -> target -> draft) and one with the step loop
(coordinator -> draft and coordinator -> target). Every hop carries the token, and each service is
given it as it might arrive from a Secret made from a file (with its newline), or with spaces.
"""

from __future__ import annotations

import argparse
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests import tiny
from tests.stack import Stack

TOKEN = "b4ck3nd-t0ken"
MAX_NEW = 12
RAW_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    folder = tmp_path_factory.mktemp("backend-token")
    target, noisy = tiny.tiny_pair(seed=0)
    stack = Stack()
    try:
        draft = stack.draft(drafter="model", model=tiny.save(noisy, folder / "draft"), backend_token=TOKEN + "\n")
        target_address = stack.target(tiny.save(target, folder / "target"), draft=draft, backend_token=f"  {TOKEN}")
        runs = stack.coordinator(target_address, draft, tiny.byte_tokenizer(), backend_token=TOKEN)
        steps = stack.coordinator(target_address, draft, tiny.byte_tokenizer(), backend_token=TOKEN, decode_runs=False)
        yield {"stack": stack, "draft": draft, "target": target_address, "model": target,
               "draft_server": stack.servers[0], "target_server": stack.servers[1],
               "runs": stack.client(runs), "steps": stack.client(steps)}
    finally:
        stack.stop()


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def refused(call) -> grpc.RpcError:
    """The error of `call()`, which must fail UNAUTHENTICATED."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
    return caught.value


def health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RAW_TIMEOUT_S).status


def reflection(channel, metadata=()):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        timeout=RAW_TIMEOUT_S, metadata=metadata)
    return [service.name for answer in answers for service in answer.list_services_response.service]


def test_the_target_refuses_calls_without_the_token_and_serves_those_with_it(services):
    store = services["target_server"].servicer.engine.store
    held = len(store)
    with grpc.insecure_channel(services["target"]) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        info = pb.TargetServiceGetInfoRequest()
        verify = pb.VerifyRequest(sequence_id="intruder", append_tokens=[1, 2, 3])
        error = refused(lambda: stub.GetInfo(info, timeout=RAW_TIMEOUT_S))
        assert "--backend-token" in error.details() and TOKEN not in error.details()
        refused(lambda: stub.GetInfo(info, timeout=RAW_TIMEOUT_S, metadata=bearer("wrong")))
        refused(lambda: stub.GetInfo(info, timeout=RAW_TIMEOUT_S, metadata=bearer(TOKEN[:-1])))
        refused(lambda: stub.GetInfo(info, timeout=RAW_TIMEOUT_S, metadata=(("authorization", TOKEN),)))  # no scheme
        refused(lambda: stub.Verify(verify, timeout=RAW_TIMEOUT_S))
        refused(lambda: list(stub.VerifySession(iter([pb.VerifySessionRequest(verify=verify)]), timeout=RAW_TIMEOUT_S)))
        refused(lambda: list(stub.Decode(iter([pb.DecodeRequest(cancel=["x"])]), timeout=RAW_TIMEOUT_S)))
        refused(lambda: stub.Release(pb.TargetServiceReleaseRequest(sequence_id="any"), timeout=RAW_TIMEOUT_S))
        assert len(store) == held, "a refused Verify opened a sequence"
        refused(lambda: reflection(channel))

        assert stub.GetInfo(info, timeout=RAW_TIMEOUT_S, metadata=bearer(TOKEN)).info.vocab_size == tiny.VOCAB
        assert stub.GetInfo(info, timeout=RAW_TIMEOUT_S, metadata=(("authorization", f"bearer {TOKEN}"),)).info.vocab_size
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING  # probes send no metadata
        assert "specdec.v1.TargetService" in reflection(channel, bearer(TOKEN))


def test_the_draft_refuses_calls_without_the_token_and_serves_those_with_it(services):
    with grpc.insecure_channel(services["draft"]) as channel:
        stub = pb_grpc.DraftServiceStub(channel)
        info = pb.DraftServiceGetInfoRequest()
        propose = pb.ProposeRequest(sequence_id="intruder", append_tokens=[1, 2, 3], max_tokens=2)
        refused(lambda: stub.GetInfo(info, timeout=RAW_TIMEOUT_S))
        refused(lambda: stub.GetInfo(info, timeout=RAW_TIMEOUT_S, metadata=bearer("wrong")))
        refused(lambda: list(stub.Propose(propose, timeout=RAW_TIMEOUT_S)))
        refused(lambda: list(stub.Drafts(iter([pb.DraftsRequest(propose=[propose])]), timeout=RAW_TIMEOUT_S)))
        refused(lambda: stub.Release(pb.DraftServiceReleaseRequest(sequence_id="any"), timeout=RAW_TIMEOUT_S))

        assert stub.GetInfo(info, timeout=RAW_TIMEOUT_S, metadata=bearer(TOKEN)).info.drafter
        proposed = list(stub.Propose(propose, timeout=RAW_TIMEOUT_S, metadata=bearer(TOKEN)))
        assert 0 < len(proposed) <= 2
        stub.Release(pb.DraftServiceReleaseRequest(sequence_id="intruder"), timeout=RAW_TIMEOUT_S, metadata=bearer(TOKEN))
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING


def generate(stub, prompt: list[int]) -> pb.GenerateResponse:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW,
                                 speculation=pb.SpeculationParams(draft_length=4, adaptive=False))
    return stub.Generate(request, timeout=60)


def test_a_stack_with_the_token_gives_the_target_alone_tokens_on_every_hop(services):
    """Runs: coordinator -> target -> draft (the target's Drafts stream); steps: coordinator -> draft
    and -> target. Both speculate (tokens drafted and accepted) and give the target's own greedy tokens."""
    link = services["target_server"].servicer.runs.link
    answered = link.messages_in
    for prompt in tiny.prompts(3, seed=5):
        expected = tiny.reference_greedy(services["model"], prompt, MAX_NEW)
        for name in ("runs", "steps"):
            response = generate(services[name], prompt)
            assert list(response.token_ids) == expected, name
            assert response.stats.draft_tokens > 0 and response.stats.accepted_tokens > 0, name
    assert link.messages_in > answered, "the drafted runs got no proposals over the target's Drafts stream"


@pytest.mark.parametrize("token", ["wrong", ""], ids=["wrong", "none"])
def test_a_coordinator_without_the_right_token_stops_at_start_with_a_clear_error(services, token):
    stack = services["stack"]
    started = time.monotonic()
    with pytest.raises(ValueError, match="--backend-token must be the same") as caught:
        stack.coordinator(services["target"], services["draft"], tiny.byte_tokenizer(), backend_token=token)
    assert time.monotonic() - started < 30, "the coordinator waited for a refusal that will not change"
    assert "target" in str(caught.value) and TOKEN not in str(caught.value)


def test_a_token_metadata_cannot_carry_is_refused_at_start_and_help_hides_it():
    from specdec.serving.config import add_arguments
    from target_service.config import ENV_PREFIX, TargetConfig

    for bad in ("two words", "caf\u00e9", "tab\there"):
        with pytest.raises(ValueError, match="--backend-token must be printable ASCII") as caught:
            TargetConfig(backend_token=bad)
        assert bad not in str(caught.value)
    assert TargetConfig(backend_token=f" {TOKEN}\n").backend_token.strip() == TOKEN
    parser = argparse.ArgumentParser()
    add_arguments(parser, TargetConfig, ENV_PREFIX, {"SPECDEC_TARGET_BACKEND_TOKEN": TOKEN})
    assert TOKEN not in parser.format_help()
    assert parser.parse_args([]).backend_token == TOKEN


@pytest.mark.slow  # three `specdec serve` processes: about 35 s on 2 cores
def test_a_tools_stack_gives_its_token_to_all_three_and_logs_none(tmp_path, monkeypatch):
    """`specdec up` and the tools' stacks (specdec_tools/stacks.py): `specdec serve` processes, each
    given the stack's token through its environment, whatever the shell left there. The coordinator
    serving shows its own token was taken (it asked both for GetInfo at start)."""
    from specdec_tools.stacks import Stack as ToolStack

    monkeypatch.setenv("SPECDEC_DRAFT_BACKEND_TOKEN", "left-in-the-shell")
    target = tiny.tiny_pair(seed=0)[0]
    model = tiny.save(target, tmp_path / "target")
    stack = ToolStack(model, tmp_path / "logs", backend_token=TOKEN)
    try:
        draft = stack.start_draft("ngram")
        stack.start_target()
        coordinator = stack.start_coordinator(draft)
        stack.wait(300)  # health answers without the token
        for address, stub, request in ((stack.target_address, pb_grpc.TargetServiceStub, pb.TargetServiceGetInfoRequest()),
                                       (draft, pb_grpc.DraftServiceStub, pb.DraftServiceGetInfoRequest())):
            with grpc.insecure_channel(address) as channel:
                get_info = stub(channel).GetInfo
                refused(lambda: get_info(request, timeout=RAW_TIMEOUT_S))  # noqa: B023 - called at once
                assert get_info(request, timeout=RAW_TIMEOUT_S, metadata=bearer(TOKEN)).info.model
        with grpc.insecure_channel(coordinator) as channel:
            prompt = tiny.prompts(1, seed=7)[0]
            response = pb_grpc.CoordinatorServiceStub(channel).Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW), timeout=60)
            assert list(response.token_ids) == tiny.reference_greedy(target, prompt, MAX_NEW)
    finally:
        stack.stop()
    logs = {path.name: path.read_text(errors="replace") for path in (tmp_path / "logs").glob("*.log")}
    assert len(logs) == 3 and not any(TOKEN in text for text in logs.values())
    assert sum("backend token required" in text for text in logs.values()) == 2  # the draft and the target
    assert any("carry the backend token" in text for text in logs.values())  # the coordinator
