"""Feature drafts (specdec/model/feature_draft.py): the target's hidden states flow Verify -> coordinator -> Propose,
and the output stays the target's own, in process and over gRPC, through rollbacks and faults."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from specdec.maths.costs import MODEL_DRAFT_PRIOR, CostModel
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import Stats
from specdec.calls.request import ProposeCall
from draft_service.engine import DraftEngine
from draft_service.drafters.feature import FeatureDrafter
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.model.feature_draft import load_feature_draft, save_feature_draft
from specdec.model.features import FeatureLog, FeatureRows
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from tests import tiny
from tests.stack import Stack
from tests.test_decode_ahead import CountingVerifier
from tests.test_loop import EvictingVerifier, FlakyProposer
from tests.test_loop import run as run_loop

MAX_NEW = 24
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target():
    return tiny.one_layer_target(seed=3)


def engines(target, **draft_kwargs):
    drafter = FeatureDrafter(tiny.feature_draft_of(target, **draft_kwargs), CPU, [tiny.EOS])
    return TargetEngine(CausalLM(target, CPU)), DraftEngine(drafter)


def run(loop: SpeculativeLoop, prompt: list[int], **kwargs) -> tuple[list[int], Stats]:
    """A fixed draft length unless a test asks for the adaptive policy."""
    return run_loop(loop, prompt, MAX_NEW, **{"adaptive": False, **kwargs})


def loop_over(verifier, proposer, **kwargs) -> SpeculativeLoop:
    return SpeculativeLoop(verifier, proposer, CostModel(MODEL_DRAFT_PRIOR), MODEL_DRAFT_PRIOR, features=True, **kwargs)


def greedy_acceptance(loop: SpeculativeLoop, target, draft_length: int, count: int = 8) -> float:
    """Runs `count` tiny prompts through `loop`, asserting each output is the target's own greedy
    decoding; returns the fraction of drafted tokens accepted (0 when nothing was drafted)."""
    accepted = drafted = 0
    for prompt in tiny.prompts(count):
        tokens, stats = run(loop, prompt, draft_length=draft_length)
        assert tokens == tiny.reference_greedy(target, prompt, MAX_NEW), prompt
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.draft_tokens
    return accepted / drafted if drafted else 0.0


@torch.inference_mode()
def final_hidden(model, tokens: list[int]) -> torch.Tensor:
    return model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]


def test_verify_returns_the_final_hidden_states_of_the_positions_it_made_canonical(target):
    engine = TargetEngine(CausalLM(target, CPU))
    prompt = tiny.prompts()[1]
    first = engine.verify(VerifyCall("s", 0, prompt, [], [], SamplingConfig(), return_features=True))
    assert first.features.start == 0 and first.features.rows == len(prompt)
    torch.testing.assert_close(first.features.values, final_hidden(target, prompt), atol=1e-4, rtol=1e-4)
    # a draft of the target's own tokens with one wrong at the end: the accepted ones come back
    expected = tiny.reference_greedy(target, prompt, 5)
    draft = expected[1:4] + [(expected[4] + 1) % 256]
    step = engine.verify(VerifyCall("s", len(prompt), [first.next_token], draft, [], SamplingConfig(), return_features=True))
    assert step.accepted == 3
    assert step.features.start == len(prompt) and step.features.end == step.cached_len == len(prompt) + 4
    canonical = prompt + expected[:4]
    torch.testing.assert_close(step.features.values, final_hidden(target, canonical)[len(prompt):], atol=1e-4, rtol=1e-4)
    plain = engine.verify(VerifyCall("t", 0, prompt, [], [], SamplingConfig()))
    assert plain.features is None


def test_batched_verify_returns_each_rows_features(target):
    engine = TargetEngine(CausalLM(target, CPU))
    prompts = tiny.prompts(3, seed=5)
    calls = [VerifyCall(f"s{i}", 0, p, [], [], SamplingConfig(), return_features=True) for i, p in enumerate(prompts)]
    results = engine.verify_batch(calls)
    for prompt, result in zip(prompts, results):
        assert result.features.rows == len(prompt)
        torch.testing.assert_close(result.features.values, final_hidden(target, prompt), atol=1e-4, rtol=1e-4)


def test_decoding_ahead_returns_the_features_of_every_position_it_fed(target):
    engine = TargetEngine(CausalLM(target, CPU))
    prompt = tiny.prompts()[2]
    expected = tiny.reference_greedy(target, prompt, 8)
    out = engine.verify(VerifyCall("s", 0, prompt, [], [], SamplingConfig(), return_features=True, decode_ahead=4))
    assert [out.next_token, *out.decoded] == expected[:5]
    # the prompt, next_token and the decoded tokens but the last: what the target now holds
    assert out.features.start == 0 and out.features.end == out.cached_len == len(prompt) + 4
    torch.testing.assert_close(out.features.values, final_hidden(target, prompt + expected[:4]), atol=1e-4, rtol=1e-4)
    # after a verified draft, the decoded positions follow the accepted ones
    more = engine.verify(VerifyCall("s", out.cached_len, [expected[4]], expected[5:7], [], SamplingConfig(), return_features=True, decode_ahead=1))
    assert more.accepted == 2 and more.features.start == len(prompt) + 4 and more.features.end == more.cached_len
    canonical = prompt + expected[:7] + [more.next_token]
    torch.testing.assert_close(more.features.values, final_hidden(target, canonical)[len(prompt) + 4:], atol=1e-4, rtol=1e-4)


class ShyProposer(LocalProposer):
    """Every other ask comes back empty (the draft drafted, the tokens are dropped), so a calibrated
    policy rests and the target decodes the rest steps ahead; the other asks claim full confidence,
    so the policy checks what the draft proposed whatever the tiny draft's probabilities are."""

    asks = 0

    async def propose(self, *args, **kwargs):
        out = await super().propose(*args, **kwargs)
        self.asks += 1
        if self.asks % 2:
            return dataclasses.replace(out, tokens=[], dists=[], confidence=[])
        return dataclasses.replace(out, confidence=[1.0] * len(out.tokens))


class FeatureGaps(CountingVerifier):
    """Counts the Verify answers whose features do not start where the last ones ended."""

    end = gaps = 0

    async def verify(self, call):
        out = await super().verify(call)
        if out.features is not None:
            self.gaps += out.features.start != self.end
            self.end = out.features.end
        return out


def test_a_resting_feature_draft_lets_the_target_decode_ahead_and_catches_up_from_its_features(target):
    verifier_engine, draft_engine = engines(target)
    saved = accepted = drafted = 0
    for prompt in tiny.prompts(6, seed=12):
        verifier = FeatureGaps(verifier_engine)
        # static costs (no cost model), as for seeded requests: the same steps on every run
        loop = SpeculativeLoop(verifier, ShyProposer(draft_engine), None, MODEL_DRAFT_PRIOR, features=True, calibrated=True)
        tokens, stats = run(loop, prompt, draft_length=4, adaptive=True)
        assert tokens == tiny.reference_greedy(target, prompt, MAX_NEW), prompt
        assert verifier.gaps == 0  # every position's features reached the coordinator, decoded ones too
        saved += stats.steps - verifier.calls
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.draft_tokens
    # exchanges were saved, and the draft, fed the decoded positions' features, still nearly agrees
    assert saved > 0 and drafted > 0 and accepted / drafted > 0.3


@pytest.mark.parametrize("draft_length", [1, 3, 8])
def test_in_process_greedy_equals_the_target_alone_and_the_draft_is_used(target, draft_length):
    verifier_engine, draft_engine = engines(target)
    loop = loop_over(LocalVerifier(verifier_engine), LocalProposer(draft_engine))
    assert greedy_acceptance(loop, target, draft_length) > 0.3  # the features arrived: the draft is nearly the target
    assert len(verifier_engine.store) == 0 and len(draft_engine.store) == 0


def test_a_pruned_head_and_a_noisy_draft_keep_the_output(target):
    kept = [t for t in range(tiny.VOCAB) if t % 7 != 3]  # some of the target's tokens are off the head
    verifier_engine, draft_engine = engines(target, kept=kept, noise=0.3)
    loop = loop_over(LocalVerifier(verifier_engine), LocalProposer(draft_engine))
    for prompt in tiny.prompts(6, seed=4):
        assert run(loop, prompt)[0] == tiny.reference_greedy(target, prompt, MAX_NEW)


def test_lost_sequences_and_a_failing_draft_change_nothing(target):
    verifier_engine, draft_engine = engines(target)
    for prompt in tiny.prompts(4, seed=2):
        expected = tiny.reference_greedy(target, prompt, MAX_NEW)
        loop = loop_over(EvictingVerifier(verifier_engine), LocalProposer(draft_engine))
        assert run(loop, prompt)[0] == expected
        loop = loop_over(LocalVerifier(verifier_engine), FlakyProposer(draft_engine))
        tokens, stats = run(loop, prompt)
        assert tokens == expected and stats.draft_failures >= 1


def test_overlap_drafts_ahead_from_predicted_features(target):
    verifier_engine, draft_engine = engines(target)
    loop = loop_over(LocalVerifier(verifier_engine), LocalProposer(draft_engine), overlap="on")
    steps = 0
    for prompt in tiny.prompts(6, seed=8):
        tokens, stats = run(loop, prompt)
        assert tokens == tiny.reference_greedy(target, prompt, MAX_NEW)
        steps += stats.runahead_steps
    assert steps > 0


def test_seeded_sampling_repeats_exactly(target):
    verifier_engine, draft_engine = engines(target)
    loop = loop_over(LocalVerifier(verifier_engine), LocalProposer(draft_engine))
    sampling = SamplingConfig(temperature=0.8, top_k=20, seed=11)
    prompt = tiny.prompts()[4]
    first, stats = run(loop, prompt, sampling=sampling, seeded=True)
    assert run(loop, prompt, sampling=sampling, seeded=True)[0] == first
    assert stats.draft_tokens > 0


def test_draft_validates_the_features_it_is_sent(target):
    _, draft_engine = engines(target)
    dim = target.config.hidden_size
    list(draft_engine.propose(ProposeCall("a", 0, [1, 2, 3], 2, features=FeatureRows(0, torch.zeros(2, dim)))))
    with pytest.raises(Exception, match="features.start"):
        draft_engine.propose(ProposeCall("a", 3, [4], 2, features=FeatureRows(3, torch.zeros(1, dim))))  # it holds 2
    with pytest.raises(Exception, match="features.dim"):
        draft_engine.propose(ProposeCall("a", 3, [4], 2, features=FeatureRows(2, torch.zeros(1, dim + 1))))
    with pytest.raises(Exception, match="past the sequence"):
        draft_engine.propose(ProposeCall("a", 3, [4], 2, features=FeatureRows(2, torch.zeros(3, dim))))
    with pytest.raises(Exception, match="float16 need"):
        FeatureRows.from_wire(0, 2, dim, b"\0" * 10)


def test_feature_log_replaces_from_start_and_refuses_gaps():
    log = FeatureLog()
    log.put(FeatureRows(0, torch.ones(3, 4)))
    log.put(FeatureRows(2, 2 * torch.ones(100, 4)))  # a re-fill from position 2, growing past capacity
    assert len(log) == 102 and log.since(1).values[0].tolist() == [1.0] * 4 and log.since(1).values[1].tolist() == [2.0] * 4
    assert log.since(102) is None
    with pytest.raises(ValueError, match="gap"):
        log.put(FeatureRows(103, torch.ones(1, 4)))
    huge = FeatureRows(0, torch.tensor([[1e6, -1e6]]))
    assert FeatureRows.from_wire(0, 1, 2, huge.to_bytes()).values.tolist() == [[65504.0, -65504.0]]
    wire = FeatureRows(5, torch.randn(3, 4))
    back = FeatureRows.from_wire(5, 3, 4, wire.to_bytes())
    torch.testing.assert_close(back.values, wire.values, atol=2e-3, rtol=1e-3)


def test_save_and_load_share_the_targets_embedding(target, tmp_path):
    target_path = tiny.save(target, tmp_path / "target")
    draft = tiny.feature_draft_of(target, kept=list(range(0, tiny.VOCAB, 2)))
    folder = save_feature_draft(draft, tmp_path / "draft", target_path, [tiny.EOS], dtype=torch.float32)
    assert not any("embed" in name for name in __import__("safetensors.torch").torch.load_file(str(folder / "model.safetensors")))
    loaded, meta = load_feature_draft(folder)
    feats, nxt = torch.randn(1, 5, target.config.hidden_size), torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(feats, nxt)[1], draft(feats, nxt)[1])
    assert meta["target"] == target_path


@pytest.fixture(scope="module")
def grpc_env(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("feature")
    target_path = tiny.save(target, folder / "target")
    draft_path = str(save_feature_draft(tiny.feature_draft_of(target), folder / "draft", target_path, [tiny.EOS], dtype=torch.float32))
    stack = Stack()
    target_addr = stack.target(target_path)
    draft_addr = stack.draft(drafter="model", model=draft_path)
    client = stack.client(stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer()))
    yield {"client": client, "draft": draft_addr, "target": target_addr}
    stack.stop()


@pytest.mark.parametrize("draft_length", [2, 5])
def test_over_grpc_greedy_equals_the_target_alone(target, grpc_env, draft_length):
    accepted = 0
    for prompt in tiny.prompts(10):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW,
                                     speculation=pb.SpeculationParams(draft_length=draft_length, adaptive=False))
        response = grpc_env["client"].Generate(request, timeout=60)
        assert list(response.token_ids) == tiny.reference_greedy(target, prompt, MAX_NEW), prompt
        accepted += response.stats.accepted_tokens
    assert accepted > 0


def test_over_grpc_the_draft_says_it_needs_features_and_rejects_bad_ones(grpc_env):
    with grpc.insecure_channel(grpc_env["draft"]) as channel:
        stub = pb_grpc.DraftServiceStub(channel)
        info = stub.GetInfo(pb.DraftServiceGetInfoRequest(), timeout=10).info
        assert info.drafter == "feature" and info.needs_features
        bad = pb.ProposeRequest(sequence_id="x", append_tokens=[1, 2], max_tokens=2,
                                features=pb.Features(start=0, rows=1, dim=64, data=b"\0" * 7))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Propose(bad, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("features:")
    with grpc.insecure_channel(grpc_env["target"]) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        response = stub.Verify(pb.VerifyRequest(sequence_id="y", append_tokens=[5, 6, 7], return_features=True), timeout=10)
        assert response.features.start == 0 and response.features.rows == 3 and len(response.features.data) == 3 * 64 * 2
        tree = pb.VerifyRequest(sequence_id="z", append_tokens=[5], return_features=True,
                                draft_tree=pb.DraftTree(parents=[-1], tokens=[3]))
        response = stub.Verify(tree, timeout=10)  # a tree's: the appended tokens and the accepted path
        assert response.features.start == 0 and response.features.rows == response.cached_len == 1 + response.accepted
