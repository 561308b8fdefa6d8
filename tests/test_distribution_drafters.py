"""Sampling is lossless with every other drafter and through the services: the target's own prompt
lookup and a predicted output, a feature draft, a draft with another tokenizer, and the model
chain through three real gRPC servers (tests/distribution.py holds the method). Apart from
tests/test_distribution.py so that the two halves run on two workers side by side.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from transformers import LlamaForCausalLM

from coordinator.local import LocalProposer
from coordinator.protocol import Stats
from draft_service.drafters.ngram import NgramDrafter
from draft_service.engine import DraftEngine
from draft_service.drafters.feature import FeatureDrafter
from protos import specdec_pb2 as pb
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig
from target_service.engine import TargetEngine
from tests import tiny
from tests.distribution import (
    samples_for,
    pair_models,
    BASELINE_REQUESTS,
    CPU,
    Cell,
    DEPTH,
    FIXED_COSTS,
    LookupCounting,
    PLAIN,
    PROMPT,
    SAMPLES,
    assert_target_distribution,
    cell_of,
    check_case,
    default_loop,
    eos_of,
    exact_joint,
    noisy,
    sample_loop,
    small_config,
    with_damped_layers,
)

pytestmark = [pytest.mark.distribution, pytest.mark.usefixtures("one_torch_thread")]

models = pytest.fixture(scope="module", name="models")(pair_models)


def test_ngram_drafted_by_the_target(models):
    """--lookup-ahead (on by default with the n-gram drafter): after the first token the target
    decodes ahead and drafts by prompt lookup itself, verifying by rejection sampling against a
    one-hot draft. Requests run past the three tokens checked, so that the second step's passes
    have room to draft inside them."""
    LookupCounting.drafted = LookupCounting.accepted = 0
    n = check_case("n-gram, drafted by the target", models, NgramDrafter(4, 1), prompt=[1, 0, 4, 1, 0, 4],
                   loop_kwargs={"drafter": "ngram"}, verifier_type=LookupCounting, max_new=DEPTH + 5)
    assert LookupCounting.drafted > 0.3 * n and 0 < LookupCounting.accepted < LookupCounting.drafted


def test_prediction_drafted_by_the_target(models):
    """A predicted output (GenerateRequest.prediction) seeds the target's lookup: from the first pass
    on, the target drafts the prediction's continuation of the prompt's tail, and rejection sampling
    against those one-hot drafts keeps the target's distribution."""
    prediction = tuple(PROMPT[-2:] + tiny.reference_greedy(models["target"], PROMPT, DEPTH + 5))
    LookupCounting.drafted = LookupCounting.accepted = 0
    n = check_case("prediction, drafted by the target", models, NgramDrafter(4, 1), loop_kwargs={"drafter": "ngram"},
                   verifier_type=LookupCounting, max_new=DEPTH + 5, prediction_ids=prediction, min_drafted=0.0)
    assert 0 < LookupCounting.accepted < LookupCounting.drafted
    with_prediction = LookupCounting.drafted / n
    # The same requests without a prediction draft only from their own repeats: counted, not checked
    # again (test_ngram_drafted_by_the_target checks that path's distribution), on fewer requests.
    LookupCounting.drafted = 0
    verifier = LookupCounting(TargetEngine(CausalLM(models["target"], CPU)), fixed_costs=FIXED_COSTS)
    loop = default_loop(verifier, LocalProposer(DraftEngine(NgramDrafter(4, 1)), fixed_costs=FIXED_COSTS), drafter="ngram")
    sample_loop(loop, PROMPT, PLAIN, eos_of(models["target"]), n=BASELINE_REQUESTS, max_new=DEPTH + 5)
    without = LookupCounting.drafted / BASELINE_REQUESTS
    assert with_prediction > 1.5 * without, (with_prediction, without)  # the prediction, not the output's own repeats, drafted


def test_feature_draft():
    """A draft over the target's hidden states (specdec/model/feature_draft.py), on the 260-token
    tiny model. Its first step has no target features yet and drafts nothing, so only tokens 2 and 3
    are drafted; more damped layers make drafting them pay. The draft samples its top 6 (--top-k 6)."""
    base = tiny.one_layer_target(seed=3)
    drafter = FeatureDrafter(tiny.feature_draft_of(base, noise=0.05), CPU, [tiny.EOS], top_k=6)
    prompt = tiny.prompts()[1][:8]
    check_case("feature draft", {"target": with_damped_layers(base, extra=8)}, drafter, sampling=SamplingConfig(temperature=0.8, top_k=6),
               prompt=prompt, loop_kwargs={"needs_features": True}, max_new=DEPTH + 1)



def test_other_tokenizer_draft():
    """A draft with another vocabulary (a byte-level BPE with merges, other ids) for the byte-level
    target: it samples from its own tokens that map one-to-one onto target tokens."""
    from draft_service.drafters.other_vocab import CrossVocabDrafter
    from specdec.model.vocab import TokenText, VocabMap
    from tests.test_other_vocab import bpe_tokenizer, move_vocab

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny.tiny_config(layers=1)).eval()
    byte_text = TokenText.from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB)
    bpe = bpe_tokenizer()
    bpe_draft = move_vocab(noisy(base, 0.08), byte_text, bpe)
    drafter = CrossVocabDrafter(CausalLM(bpe_draft, CPU), VocabMap.build(TokenText.from_tokenizer(bpe, bpe_draft.config.vocab_size), byte_text), 8)
    check_case("other tokenizer", {"target": with_damped_layers(base, extra=6, damping=0.2)}, drafter, sampling=SamplingConfig(temperature=0.8, top_k=6),
               prompt=tiny.prompts()[1][:8])



# -- through the real services ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_models():
    """The model chain pair at width 256 (one draft layer, a target of it and eight damped layers):
    through three processes a draft token also costs a round trip, and on 16-wide models, whose
    forwards are mostly Python, the learned costs at 8 concurrent requests drafted almost nothing
    on one CI machine (36 tokens in 833 requests). Here a target pass costs several draft steps,
    so the default policy drafts whatever the machine."""
    torch.manual_seed(0)
    config = small_config(1)
    config.hidden_size, config.intermediate_size, config.initializer_range = 256, 1024, 0.06  # as spread as the 16-wide one
    config.num_attention_heads, config.num_key_value_heads = 4, 2
    base = LlamaForCausalLM(config).eval()
    return {"target": with_damped_layers(base, extra=8), "draft": noisy(base, 0.1, 1)}


@pytest.fixture(scope="module")
def stack(wide_models, tmp_path_factory):
    """Target, model draft and coordinator as real gRPC servers on loopback, every flag at its default
    but the models: float32 probabilities on the wire, both continuous batchers, admission control."""
    from tests.stack import Stack

    models = wide_models
    folder = tmp_path_factory.mktemp("distribution")
    for name in ("target", "draft"):
        models[name].save_pretrained(folder / name)
    services = Stack()
    try:
        target = services.target(str(folder / "target"))
        draft = services.draft(drafter="model", model=str(folder / "draft"))
        default = services.coordinator(target, draft, tiny.byte_tokenizer())
        # With 8 requests running, the default load cap (--verify-token-budget 8) leaves no room for
        # draft tokens at all: the batched case lifts it so that its batches verify drafts.
        uncapped = services.coordinator(target, draft, tiny.byte_tokenizer(), verify_token_budget=0)
        # A target that asks its draft itself (--draft): drafted runs, plain and pipelined
        drafting = services.target(str(folder / "target"), draft=draft)
        drafted = services.coordinator(drafting, draft, tiny.byte_tokenizer(), verify_token_budget=0)
        pipelined = services.coordinator(drafting, draft, tiny.byte_tokenizer(), verify_token_budget=0, overlap="on")
        yield {1: services.client(default), 8: services.client(uncapped), "drafted": services.client(drafted),
               "pipelined": services.client(pipelined), "servers": services.servers}
    finally:
        services.stop()


GRPC_SAMPLES = SAMPLES * 5 // 6  # ~20 ms a request through three services


def sample_grpc(client, prompt: list[int], sampling: SamplingConfig, eos: set[int], concurrency: int,
                speculation: pb.SpeculationParams | None = None, n: int = GRPC_SAMPLES, max_new: int = DEPTH) -> tuple[list[Cell], Stats]:
    """n unseeded Generate calls, `concurrency` in flight at a time; their first tokens."""
    def one(_):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new,
                                     sampling=pb.SamplingParams(temperature=sampling.temperature), speculation=speculation)
        return client.Generate(request, timeout=60)

    total = Stats()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        responses = list(pool.map(one, range(n)))
    for response in responses:
        total.draft_tokens += response.stats.draft_tokens
        total.accepted_tokens += response.stats.accepted_tokens
    return [cell_of(list(r.token_ids), eos) for r in responses], total


# The step loop over gRPC: in test-all (the suite's time); the drafted runs below keep one gRPC case in the fast tier.
@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 8], ids=["one stream", "8 concurrent"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["two tokens a step", "adaptive"])
def test_through_grpc_services(wide_models, stack, concurrency, adaptive):
    """The model chain case over gRPC; with 8 requests at once, the target verifies them in shared
    batched passes and the draft drafts them in shared forwards. The services time their passes
    themselves, so the default adaptive policy drafts as much as this machine's timings say: those
    cases are `slow`, and the suite's own ask for two draft tokens a step (not adaptive)."""
    target, eos = wide_models["target"], eos_of(wide_models["target"])
    speculation = None if adaptive else pb.SpeculationParams(draft_length=2, adaptive=False)
    exact = exact_joint(target, PROMPT, PLAIN, eos)
    samples, total = sample_grpc(stack[concurrency], PROMPT, PLAIN, eos, concurrency, speculation, samples_for(exact, most=GRPC_SAMPLES))
    # Adaptive: the learned costs count the draft's round trip here, so fewer steps draft than in
    # process. Two tokens a step: the first step of every request drafts 2.
    least = 0.1 if adaptive else 1.0
    assert total.draft_tokens > least * len(samples) and 0.1 * total.draft_tokens <= total.accepted_tokens <= 0.9 * total.draft_tokens, \
        f"{total.accepted_tokens} of {total.draft_tokens} draft tokens accepted"
    name = f"gRPC, {concurrency} at once, {'adaptive' if adaptive else 'two tokens a step'}"
    assert_target_distribution(name, samples, exact, total)


# pipelined over gRPC in test-all (the suite's time): test_overlap_on and the lost-bet case check it in process
@pytest.mark.parametrize("mode", ["drafted", pytest.param("pipelined", marks=pytest.mark.slow)])
@pytest.mark.parametrize("concurrency", [1, pytest.param(8, marks=pytest.mark.slow)], ids=["one stream", "8 concurrent"])
def test_through_grpc_drafted_runs(wide_models, stack, mode, concurrency):
    """The target asks its draft itself (target_service/runs.py), and pipelined, the draft drafts
    the next step on the bet that this one is accepted whole: still the target's distribution."""
    target, eos = wide_models["target"], eos_of(wide_models["target"])
    # One token a step, and two more tokens than are checked: a pipelined run's bet on the first
    # step then drafts the second step, whose tokens are among the three checked.
    speculation = pb.SpeculationParams(draft_length=1, adaptive=False)
    runs = stack["servers"][4].servicer.runs  # the target with --draft
    hits = runs.hits
    exact = exact_joint(target, PROMPT, PLAIN, eos)
    samples, total = sample_grpc(stack[mode], PROMPT, PLAIN, eos, concurrency, speculation, samples_for(exact, most=GRPC_SAMPLES),
                                 max_new=DEPTH + 2)
    assert total.draft_tokens > len(samples) and 0.1 * total.draft_tokens <= total.accepted_tokens <= 0.9 * total.draft_tokens, \
        f"{total.accepted_tokens} of {total.draft_tokens} draft tokens accepted"
    if mode == "pipelined":
        assert runs.hits - hits > 0.05 * len(samples), f"{runs.hits - hits} steps drafted ahead in {len(samples)} requests"
    assert_target_distribution(f"gRPC drafted runs, {mode}, {concurrency} at once", samples, exact, total)

