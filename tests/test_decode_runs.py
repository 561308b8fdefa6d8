"""Decoding runs (target_service/runs.py, coordinator/decode_stream.py): a request whose passes need
no draft service is one run in the target, on one Decode stream per coordinator.

What must hold: the tokens are exactly the target's (greedy) and exactly the step loop's (seeded
sampling, keyed by position); many runs share one stream and one message a pass, not one per run;
a run a client leaves, or whose coordinator goes away, frees its sequence at once; a target that
restarts mid-run costs a restart of the run, not different tokens; bad input names its field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest

from coordinator.clients import TargetClient
from specdec.calls.request import VerifyCall
from specdec.maths.sampling import SamplingConfig
from target_service.runs import Run
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests import tiny
from tests.services import Service
from tests.stack import Stack

MAX_NEW = 40


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=5)


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory):
    """One target; coordinators with runs (n-gram, and speculation off) and one without."""
    folder = tmp_path_factory.mktemp("runs")
    stack = Stack()
    target = stack.target(str(tiny.save(pair[0], folder / "target")))
    addresses = {"lookup": stack.coordinator(target, "ngram", tiny.byte_tokenizer()),
                 "off": stack.coordinator(target, "", tiny.byte_tokenizer()),
                 "steps": stack.coordinator(target, "ngram", tiny.byte_tokenizer(), decode_runs=False),
                 "bursts": stack.coordinator(target, "", tiny.byte_tokenizer(), stream_interval=4)}
    yield stack, {name: stack.client(address) for name, address in addresses.items()}
    stack.stop()


def echoing(pair, n: int) -> list[list[int]]:
    """Prompts whose continuation prompt lookup often finds (tests/test_lookup_ahead.py)."""
    return [x + tiny.reference_greedy(pair[0], x, 12) + x for x in tiny.prompts(n, seed=21)]


def generate(stub, prompt, **kwargs) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW, **kwargs), timeout=60)


def decoders(stack) -> list:
    """The coordinators' Decode streams (None where a coordinator runs no runs)."""
    return [server.servicer.loop.decoder for server in stack.servers[1:]]


def target_engine(stack):
    return stack.servers[0].servicer.engine


def wait_free(engine, seconds: float = 5.0) -> int:
    deadline = time.monotonic() + seconds
    while len(engine.store) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(engine.store)


def test_greedy_runs_are_the_target_alone_and_stream_every_pass(stack, pair):
    stack, stubs = stack
    for prompt in echoing(pair, 4):
        expected = tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        for name in ("lookup", "off"):
            response = generate(stubs[name], prompt, speculation=pb.SpeculationParams(draft_length=8))
            assert list(response.token_ids) == expected, name
            chunks = list(stubs[name].GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt),
                                                                              max_new_tokens=MAX_NEW), timeout=60))
            assert [t for c in chunks for t in c.token_ids] == expected, name
            # tokens come as the passes make them, not in bursts of --decode-ahead passes
            assert sum(1 for c in chunks if c.token_ids) > MAX_NEW // 2, name
    batcher = stack.servers[0].servicer.batcher
    before = batcher.batches
    streamed = stubs["off"].GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW), timeout=60)
    assert sum(len(c.token_ids) for c in streamed) == MAX_NEW
    assert batcher.batches - before <= 2, "a lone streamed run is one call to the batcher (two if the idle sweep interrupted it)"
    lookup = generate(stubs["lookup"], echoing(pair, 1)[0], speculation=pb.SpeculationParams(draft_length=8)).stats
    assert lookup.steps < MAX_NEW and lookup.accepted_tokens > 0, "the run's lookup drafts saved no pass"
    assert decoders(stack)[0].opened == 1, "one stream serves every run of a coordinator"
    assert decoders(stack)[2] is None
    assert wait_free(target_engine(stack)) == 0


def test_a_stream_interval_sends_the_first_token_at_once_then_bursts(stack, pair):
    """--stream-interval 4: the same tokens, at least 4 a message between the first (sent as soon
    as the writer turns, whatever it holds then) and the last."""
    stack, stubs = stack
    for prompt in tiny.prompts(3, seed=4):
        expected = tiny.reference_greedy(pair[0], prompt, MAX_NEW)
        request = pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW)
        chunks = [list(c.token_ids) for c in stubs["bursts"].GenerateStream(request, timeout=60) if c.token_ids]
        assert [t for c in chunks for t in c] == expected
        assert all(len(c) >= 4 for c in chunks[1:-1]), [len(c) for c in chunks]
        assert len(chunks) <= 2 + MAX_NEW // 4


@pytest.mark.parametrize("every", [0, 1, 4])
def test_a_runs_progress_is_due_at_its_first_token_every_n_tokens_and_its_end(every):
    run = Run("r", VerifyCall("r", 0, [1], [], [], SamplingConfig()), 40, frozenset(), length=1, append=[1], report_every=every)
    assert not run.due()  # nothing made yet
    run.take([5], [])
    assert run.due()  # the first token: at once
    run.reported, run.out = 1, None
    for made in range(1, 4):
        run.take([6], [])
        assert run.due() == (every <= 1), made
    run.take([7], [])
    assert run.due()  # four held
    run.reported, run.out = 5, None
    run.take([8], [])
    run.ending = True
    assert run.due()  # the end goes out whatever it holds


def test_seeded_sampling_in_a_run_is_the_step_loops(stack, pair):
    """Speculation off, seeded: a run makes the draws the Verify exchanges make (keyed by position)."""
    stack, stubs = stack
    sampling = pb.SamplingParams(temperature=0.9, top_k=20, seed=1234)
    for prompt in tiny.prompts(3, seed=8):
        speculation = pb.SpeculationParams(draft_length=0)
        runs = generate(stubs["lookup"], prompt, sampling=sampling, speculation=speculation)
        steps = generate(stubs["steps"], prompt, sampling=sampling, speculation=speculation)
        assert list(runs.token_ids) == list(steps.token_ids)
        assert list(generate(stubs["off"], prompt, sampling=sampling).token_ids) == list(runs.token_ids)


def test_concurrent_runs_share_one_message_a_pass(stack, pair):
    stack, stubs = stack
    decoder = decoders(stack)[1]
    before_in, before_out = decoder.messages_in, decoder.messages_out
    prompts = tiny.prompts(8, seed=2)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: generate(stubs["off"], p), prompts))
    for prompt, response in zip(prompts, responses):
        assert list(response.token_ids) == tiny.reference_greedy(pair[0], prompt, MAX_NEW)
    received, sent = decoder.messages_in - before_in, decoder.messages_out - before_out
    tokens = sum(len(r.token_ids) for r in responses)
    print(f"\n{len(prompts)} concurrent runs, {tokens} tokens: {received} DecodeResponses, {sent} DecodeRequests")
    assert sent <= len(prompts)
    # a message per run per pass would be ~`tokens` messages; batched, about one per pass
    assert received < tokens / 2


def test_a_run_left_by_its_client_or_stopped_by_a_stop_string_frees_its_sequence(stack, pair):
    stack, stubs = stack
    engine = target_engine(stack)
    prompt = tiny.prompts(1, seed=4)[0]
    for _ in range(20):
        call = stubs["off"].GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=400), timeout=30)
        next(call)
        call.cancel()
    assert wait_free(engine) == 0
    full = stubs["off"].Generate(pb.GenerateRequest(text="abc", max_new_tokens=MAX_NEW), timeout=30)
    stop = full.text[3:5]
    cut = stubs["off"].Generate(pb.GenerateRequest(text="abc", max_new_tokens=MAX_NEW, stop=[stop]), timeout=30)
    assert cut.finish_reason == pb.FINISH_REASON_STOP_STRING
    assert cut.text == full.text[: full.text.index(stop)]
    assert wait_free(engine) == 0


def test_runs_of_a_coordinator_that_went_away_are_freed_at_once(pair, tmp_path):
    stack = Stack()
    try:
        target = stack.target(str(tiny.save(pair[0], tmp_path / "target")))
        engine = target_engine(stack)

        async def start_and_vanish():
            client = TargetClient(target, 5.0)
            from coordinator.protocol import DecodeRun
            from specdec.maths.sampling import SamplingConfig
            runs = [client.decoder.decode(DecodeRun(f"s{i}", p, SamplingConfig(), 400, frozenset()))
                    for i, p in enumerate(tiny.prompts(3, seed=6))]
            for run in runs:
                await anext(run)  # every run is decoding
            held = len(engine.store)
            await client.channel.close()  # the coordinator is gone, no cancel sent
            return held

        held = asyncio.run_coroutine_threadsafe(start_and_vanish(), stack.loop).result(60)
        assert held == 3
        assert wait_free(engine, 5.0) == 0, "a vanished coordinator's runs kept their caches"
    finally:
        stack.stop()


def test_bad_runs_are_refused_with_the_field_named_and_the_stream_goes_on(stack, pair):
    stack, _ = stack
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.servers[0].port}")
    try:
        stub = pb_grpc.TargetServiceStub(channel)
        prompt = tiny.prompts(1, seed=1)[0]
        requests = [pb.DecodeRequest(start=[pb.DecodeRun(sequence_id="bad-max", append_tokens=prompt, max_new_tokens=0),
                                            pb.DecodeRun(sequence_id="bad-token", append_tokens=[10**6], max_new_tokens=4),
                                            pb.DecodeRun(sequence_id="bad-report", append_tokens=prompt, max_new_tokens=4,
                                                         report_every=65),
                                            pb.DecodeRun(sequence_id="good", append_tokens=prompt, max_new_tokens=4)])]
        ends = {}
        tokens = []
        seen = []
        for response in stub.Decode(iter(requests), timeout=30):
            seen.append(str(response))
            for run in response.runs:
                if run.sequence_id == "good":
                    tokens += run.tokens
                if run.done:
                    ends[run.sequence_id] = (grpc.StatusCode.OK if not run.error_code else
                                             {c.value[0]: c for c in grpc.StatusCode}[run.error_code], run.error_message)
        assert "bad-token" in ends, seen
        assert ends["bad-max"][0] == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in ends["bad-max"][1]
        assert ends["bad-token"][0] == grpc.StatusCode.INVALID_ARGUMENT and "append_tokens" in ends["bad-token"][1]
        assert ends["bad-report"][0] == grpc.StatusCode.INVALID_ARGUMENT and "report_every" in ends["bad-report"][1]
        assert ends["good"][0] == grpc.StatusCode.OK
        assert tokens == tiny.reference_greedy(pair[0], prompt, 4)
    finally:
        channel.close()


def test_a_fleet_gets_a_stream_per_run_one_target_one_stream():
    from coordinator.decode_stream import DecodeStream, StreamPerRun

    async def decoders():  # grpc.aio channels belong to an event loop
        clients = [TargetClient("127.0.0.1:1,127.0.0.1:2", 1.0), TargetClient("127.0.0.1:1", 1.0)]
        kinds = [type(client.decoder) for client in clients]
        for client in clients:
            await client.close()
        return kinds

    assert asyncio.run(decoders()) == [StreamPerRun, DecodeStream]


def test_target_restarted_mid_run_gives_the_same_tokens(pair, tmp_path):
    path = str(tiny.save(pair[0], tmp_path / "target"))
    target = Service("target", "--model", path, "--device", "cpu", "--metrics-port", "-1").start()
    stack = Stack()
    try:
        stub = stack.client(stack.coordinator(target.address, "", tiny.byte_tokenizer(), target_retry_s=60))
        prompt = tiny.prompts(1, seed=9)[0]
        expected = tiny.reference_greedy(pair[0], prompt, 300)
        call = stub.GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=300), timeout=120)
        tokens = list(next(call).token_ids)
        target.kill()
        target.start(wait=0)
        for chunk in call:
            tokens += chunk.token_ids
        assert tokens == expected
    finally:
        target.stop()
        stack.stop()


# --- drafted runs: the target asks its own draft service (TargetService --draft) ------------------

@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """A model draft and a feature draft, each the --draft of its own target; coordinators on each
    with drafted runs, and one on the model draft's target with the step loop."""
    from specdec.model.feature_draft import save_feature_draft
    import torch

    folder = tmp_path_factory.mktemp("drafted")
    target, noisy = tiny.tiny_pair(seed=0)
    target_path = tiny.save(target, folder / "target")
    one_layer = tiny.one_layer_target(seed=3)  # a feature draft nearly reproduces a one-layer target (tests/tiny.py)
    one_layer_path = tiny.save(one_layer, folder / "one-layer")
    feature_path = str(save_feature_draft(tiny.feature_draft_of(one_layer), folder / "feature", one_layer_path, [tiny.EOS],
                                          dtype=torch.float32))
    stack = Stack()
    model_draft = stack.draft(drafter="model", model=tiny.save(noisy, folder / "draft"))
    model_target = stack.target(target_path, draft=model_draft)
    feature_draft = stack.draft(drafter="model", model=feature_path)
    feature_target = stack.target(one_layer_path, draft=feature_draft)
    clients = {"runs": stack.client(stack.coordinator(model_target, model_draft, tiny.byte_tokenizer())),
               "steps": stack.client(stack.coordinator(model_target, model_draft, tiny.byte_tokenizer(), decode_runs=False)),
               "feature": stack.client(stack.coordinator(feature_target, feature_draft, tiny.byte_tokenizer())),
               "pipelined": stack.client(stack.coordinator(model_target, model_draft, tiny.byte_tokenizer(), overlap="on"))}
    yield {"stack": stack, "clients": clients, "target": target, "one_layer": one_layer}
    stack.stop()


def test_drafted_runs_give_the_step_loops_tokens_and_drafts(drafted):
    """Fixed draft lengths: the same proposals as the coordinator's loop asks for, so the same stats too."""
    clients, target = drafted["clients"], drafted["target"]
    link = drafted["stack"].servers[1].servicer.runs.link
    asked = link.messages_out
    for prompt in tiny.prompts(4, seed=3):
        expected = tiny.reference_greedy(target, prompt, MAX_NEW)
        speculation = pb.SpeculationParams(draft_length=4, adaptive=False)
        runs, steps = (generate(clients[name], prompt, speculation=speculation) for name in ("runs", "steps"))
        assert list(runs.token_ids) == list(steps.token_ids) == expected
        assert (runs.stats.steps, runs.stats.draft_tokens, runs.stats.accepted_tokens) == \
            (steps.stats.steps, steps.stats.draft_tokens, steps.stats.accepted_tokens)
        assert 0 < runs.stats.accepted_tokens < runs.stats.draft_tokens
        adaptive = generate(clients["runs"], prompt, speculation=pb.SpeculationParams(draft_length=8))
        assert list(adaptive.token_ids) == expected
    assert link.messages_out > asked, "the runs did not draft through the target's draft service"
    for server in drafted["stack"].servers[:2]:  # the model draft and its target
        assert wait_free(server.servicer.engine) == 0


def test_concurrent_drafted_runs_ask_the_draft_in_shared_messages(drafted):
    clients, target = drafted["clients"], drafted["target"]
    link = drafted["stack"].servers[1].servicer.runs.link
    asks, sent, received = link.asks, link.messages_out, link.messages_in
    prompts = tiny.prompts(8, seed=6)
    speculation = pb.SpeculationParams(draft_length=3, adaptive=False)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: generate(clients["runs"], p, speculation=speculation), prompts))
    for prompt, response in zip(prompts, responses):
        assert list(response.token_ids) == tiny.reference_greedy(target, prompt, MAX_NEW)
    asks, sent, received = link.asks - asks, link.messages_out - sent, link.messages_in - received
    print(f"\n8 concurrent drafted runs: {asks} asks in {sent} DraftsRequests, answered in {received} DraftsResponses")
    assert sent < asks / 2 and received < asks / 2


def test_drafted_runs_sample_as_the_step_loop_does(drafted):
    clients = drafted["clients"]
    for prompt in tiny.prompts(3, seed=4):
        request = dict(sampling=pb.SamplingParams(temperature=0.8, top_k=30, seed=99), speculation=pb.SpeculationParams(draft_length=4))
        runs, steps = (generate(clients[name], prompt, **request) for name in ("runs", "steps"))
        assert list(runs.token_ids) == list(steps.token_ids)


def test_a_feature_draft_drafts_in_runs_from_the_targets_features(drafted):
    target = drafted["one_layer"]
    accepted = 0
    for prompt in tiny.prompts(6):
        response = generate(drafted["clients"]["feature"], prompt, speculation=pb.SpeculationParams(draft_length=5, adaptive=False))
        assert list(response.token_ids) == tiny.reference_greedy(target, prompt, MAX_NEW)
        accepted += response.stats.accepted_tokens
    assert accepted > 0
    assert drafted["stack"].servers[3].servicer.runs.link.messages_in > 0


def test_pipelined_runs_give_the_same_tokens_and_use_their_bets(drafted):
    """--overlap on: the draft drafts the next step during each pass; a won bet is the next draft."""
    clients, target = drafted["clients"], drafted["target"]
    runs = drafted["stack"].servers[1].servicer.runs
    hits = runs.hits
    for prompt in tiny.prompts(4, seed=3):
        expected = tiny.reference_greedy(target, prompt, MAX_NEW)
        response = generate(clients["pipelined"], prompt, speculation=pb.SpeculationParams(draft_length=3, adaptive=False))
        assert list(response.token_ids) == expected
        assert response.stats.accepted_tokens > 0
    assert runs.hits > hits, "no step used a draft drafted during the pass before"


def test_a_coordinator_with_another_draft_keeps_its_own(drafted):
    """The target's draft is used only by a coordinator naming that same draft."""
    stack = drafted["stack"]
    other = stack.coordinator(f"127.0.0.1:{stack.servers[1].port}", f"127.0.0.1:{stack.servers[2].port}", tiny.byte_tokenizer())
    assert not stack.servers[-1].servicer.loop.target_drafts
    prompt = tiny.prompts(1, seed=5)[0]
    assert list(generate(stack.client(other), prompt).token_ids) == tiny.reference_greedy(drafted["target"], prompt, MAX_NEW)


def test_a_draft_killed_mid_run_leaves_the_tokens_unchanged(tmp_path):
    target, noisy = tiny.tiny_pair(seed=0)
    draft = Service("draft", "--drafter", "model", "--model", tiny.save(noisy, tmp_path / "draft"), "--device", "cpu",
                    "--metrics-port", "-1").start()
    stack = Stack()
    try:
        target_addr = stack.target(tiny.save(target, tmp_path / "target"), draft=draft.address)
        stub = stack.client(stack.coordinator(target_addr, draft.address, tiny.byte_tokenizer()))
        prompt = tiny.prompts(1, seed=2)[0]
        call = stub.GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=300,
                                                            speculation=pb.SpeculationParams(draft_length=4, adaptive=False)),
                                   timeout=120)
        tokens = list(next(call).token_ids)
        draft.kill()
        for chunk in call:
            tokens += chunk.token_ids
        assert tokens == tiny.reference_greedy(target, prompt, 300)
        assert wait_free(target_engine(stack)) == 0
    finally:
        draft.stop()
        stack.stop()


def test_a_target_that_stays_away_fails_the_run_unavailable(pair, tmp_path):
    target = Service("target", "--model", str(tiny.save(pair[0], tmp_path / "target")), "--device", "cpu", "--metrics-port", "-1").start()
    stack = Stack()
    try:
        stub = stack.client(stack.coordinator(target.address, "", tiny.byte_tokenizer(), target_retry_s=1.0))
        prompt = tiny.prompts(1, seed=9)[0]
        call = stub.GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=400), timeout=60)
        next(call)
        target.kill()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in call:
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert time.monotonic() - started < 10
    finally:
        target.stop()
        stack.stop()
