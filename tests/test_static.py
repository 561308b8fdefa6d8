"""Fixed-shape passes over a static cache (specdec/model/gpu/static.py): every position's logits are the
same bits decoded alone, verified in a chain, in a tree, or batched with other sequences, so greedy
speculation returns exactly the engine's own tokens. On the CPU always; on CUDA (bf16, fp16, fp32,
with CUDA graphs and the Triton attention) where a GPU is present.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.errors import Overloaded
from specdec.kv.store import Sequence
from specdec.model.gpu import static
from specdec.model.gpu.static import StaticLM, attention_reference, exact_lm, static_supported
from specdec.maths.sampling import SamplingConfig
from specdec.maths.tree import DraftTree
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from specdec_tools.tinymodels import real_shape

GREEDY = SamplingConfig()
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]


def small_model(seed: int = 0, vocab: int = 300) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def lm_on(model, device: str, dtype: torch.dtype, pass_rows: int = 16, slots: int = 12) -> StaticLM:
    return StaticLM(model.to(device=device, dtype=dtype), torch.device(device), pass_rows=pass_rows, slots=slots)


def decode_alone(engine: TargetEngine, name: str, prompt: list[int], n: int) -> list[int]:
    """The target alone: one Verify with no draft tokens per token."""
    tokens, known = list(prompt), 0
    while len(tokens) - len(prompt) < n:
        result = engine.verify(VerifyCall(name, known, tokens[known:], [], [], GREEDY))
        tokens.append(result.next_token)
        known = result.cached_len
    engine.store.release(name)
    return tokens[len(prompt):]


class Speculator:
    """One sequence decoded with drafts that copy the reference continuation, cut and corrupted at
    random: every step mixes acceptance, rejection, the bonus token and draft length 0."""

    def __init__(self, name: str, prompt: list[int], reference: list[int], rng: random.Random, vocab: int):
        self.name, self.prompt, self.reference, self.rng, self.vocab = name, prompt, reference, rng, vocab
        self.tokens, self.known = list(prompt), 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def done(self) -> bool:
        return len(self.generated) >= len(self.reference)

    def _guess(self, length: int) -> list[int]:
        at = len(self.generated)
        draft = list(self.reference[at:at + length])
        if draft and self.rng.random() < 0.5:
            draft[self.rng.randrange(len(draft))] = self.rng.randrange(self.vocab)
        return draft

    def call(self, tree: bool = False) -> VerifyCall:
        if not tree:
            return VerifyCall(self.name, self.known, self.tokens[self.known:], self._guess(self.rng.choice([0, 1, 3, 5, 8])), [], GREEDY)
        path = self._guess(4)
        parents, tokens = [], []
        for depth, token in enumerate(path):  # the guessed path, and a wrong sibling at every depth
            parent = -1 if depth == 0 else 2 * (depth - 1)
            parents += [parent, parent]
            tokens += [token, (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab]
        return VerifyCall(self.name, self.known, self.tokens[self.known:], [], [], GREEDY,
                          tree=DraftTree(parents, tokens) if tokens else None)

    def apply(self, call: VerifyCall, result) -> None:
        accepted = [call.tree.tokens[i] for i in result.path] if call.tree else call.draft_tokens[:result.accepted]
        self.tokens += accepted + [result.next_token]
        self.known = result.cached_len


def speculate(engine: TargetEngine, prompts: list[list[int]], references: list[list[int]], batched: bool, tree: bool,
              seed: int = 0, name: str = "s") -> list[list[int]]:
    rng = random.Random(seed)
    decoders = [Speculator(f"{name}{i}", p, r, rng, engine.lm.vocab_size) for i, (p, r) in enumerate(zip(prompts, references))]
    while not all(d.done for d in decoders):
        active = [d for d in decoders if not d.done]
        calls = [d.call(tree and i % 2 == 0) for i, d in enumerate(active)]
        if batched:
            results = engine.verify_batch(calls)
        else:
            results = [engine.verify_tree(c) if c.tree else engine.verify_batch([c])[0] for c in calls]
        for decoder, call, result in zip(active, calls, results):
            assert not isinstance(result, Exception), result
            decoder.apply(call, result)
    for d in decoders:
        engine.store.release(d.name)
    return [d.generated[:len(d.reference)] for d in decoders]


def prompts_for(vocab: int, count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


# -- the pieces ----------------------------------------------------------------------------------------

def test_agrees_with_transformers_forward():
    """The fixed-shape forward is the model: float32 logits within rounding of transformers' own."""
    model = small_model()
    lm = lm_on(model, "cpu", torch.float32)
    prompt = [5, 17, 3, 99, 42, 7]
    logits = lm.forward(Sequence("a", tokens=list(prompt)), [], keep=len(prompt))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("biases", [dict(attention_bias=True), dict(mlp_bias=True), dict(attention_bias=True, mlp_bias=True)],
                         ids=["attention", "mlp", "both"])
def test_every_bias_the_config_declares_is_applied(biases):
    """Llama configs may give the attention projections and the MLP biases: the fixed-shape forward
    computes the model with all of them (it once dropped o_proj's and the MLP's)."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, **biases)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.5)  # biases a dropped one could not hide behind
    prompt = [5, 17, 3, 99, 42, 7]
    logits = lm_on(model, "cpu", torch.float32).forward(Sequence("a", tokens=list(prompt)), [], keep=len(prompt))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_reference_attention_matches_softmax_attention():
    torch.manual_seed(0)
    T, H, G, D, C = 5, 4, 2, 16, 200
    keys, values = torch.randn(3, G, C, D), torch.randn(3, G, C, D)
    q = torch.randn(T, H, D)
    slots = torch.tensor([0, 1, 2, 1, 0])
    prefix = torch.tensor([1, 70, 130, 20, 3])
    tail = torch.zeros(T, static.MAX_TAIL, dtype=torch.long)
    tail[3, :2] = torch.tensor([150, 152])
    tail_len = torch.tensor([0, 0, 0, 2, 0])
    out = attention_reference(q, keys, values, slots, prefix, tail, tail_len, D ** -0.5)
    for t in range(T):
        index = list(range(int(prefix[t]))) + tail[t, :int(tail_len[t])].tolist()
        k = keys[slots[t]][:, index].repeat_interleave(2, 0)  # [H, n, D]
        v = values[slots[t]][:, index].repeat_interleave(2, 0)
        weights = torch.softmax((q[t][:, None] * k).sum(-1) * D ** -0.5, -1)
        torch.testing.assert_close(out[t], (weights[..., None] * v).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_position_has_the_same_bits_alone_and_among_others(device, dtype):
    """Decoded one at a time, verified 39 at once (across passes of 16 rows), or beside another
    sequence: the logits of every position are equal, not close."""
    lm = lm_on(small_model(), device, dtype)
    alone, seq = [], Sequence("a", tokens=[1, 2, 3])
    for _ in range(40):
        row = lm.forward(seq, [], keep=1)[0]
        alone.append(row)
        seq.tokens.append(int(row.argmax()))
    generated = seq.tokens[3:]
    together = lm.forward(Sequence("b", tokens=[1, 2, 3]), generated[:39], keep=40)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    other, again = Sequence("c", tokens=[9, 8, 7, 6]), Sequence("d", tokens=[1, 2, 3])
    batched, _ = lm.forward_batch([other, again], [[5], generated[:9]], [2, 10])
    assert all(torch.equal(a, b) for a, b in zip(alone[:10], batched[1]))


# -- through the target engine ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["chain", "tree", "batched chains and trees"])
def test_greedy_speculation_equals_decoding_alone(device, dtype, mode):
    lm = lm_on(small_model(), device, dtype)
    engine = TargetEngine(lm, max_sequences=64)
    prompts = prompts_for(lm.vocab_size, 8 if mode.startswith("batched") else 2)
    references = [decode_alone(engine, f"r{i}", p, 16 if device == "cpu" else 24) for i, p in enumerate(prompts)]
    spoken = speculate(engine, prompts, references, batched=mode.startswith("batched"), tree=mode != "chain")
    assert spoken == references


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_the_targets_own_lookup_drafts_and_passes_ahead_give_the_tokens_decoded_alone(device, batched):
    """The target drafting for itself by prompt lookup (VerifyCall.lookup_draft_length) on every pass
    without a draft, alone with passes decoded ahead or as rows of a batch, on fixed-shape passes:
    the tokens are the engine's own decoded one at a time, and lookup drafts were made and accepted."""
    lm = lm_on(small_model(seed=3), device, torch.float32)
    engine = TargetEngine(lm, max_sequences=64)
    rng = random.Random(5)
    prompts = [[rng.randrange(lm.vocab_size) for _ in range(12)] * 3 for _ in range(4 if batched else 2)]
    n = 24
    references = [decode_alone(engine, f"r{i}", p, n) for i, p in enumerate(prompts)]
    states = [(list(p), 0) for p in prompts]
    drafted = accepted = 0
    while any(len(t) - len(p) < n for (t, _), p in zip(states, prompts)):
        active = [i for i, ((t, _), p) in enumerate(zip(states, prompts)) if len(t) - len(p) < n]
        calls = [VerifyCall(f"l{i}", states[i][1], states[i][0][states[i][1]:], [], [], GREEDY, lookup_draft_length=8,
                            decode_ahead=0 if batched else 16) for i in active]
        results = engine.verify_batch(calls, decode_ahead=not batched)
        for i, result in zip(active, results):
            assert not isinstance(result, Exception), result
            tokens, _ = states[i]
            states[i] = (tokens + [result.next_token, *result.decoded], result.cached_len)
            drafted, accepted = drafted + result.ahead_drafted, accepted + result.ahead_accepted
    assert [t[len(p):len(p) + n] for (t, _), p in zip(states, prompts)] == references
    assert drafted and accepted  # the lookup path ran, and its verdicts kept some drafts


def test_sequences_past_the_slots_are_evicted_and_refilled():
    """The engine holds at most --static-slots sequences; the least recently used goes, and a
    released or evicted sequence's slot is free again."""
    lm = lm_on(small_model(), "cpu", torch.float32, slots=2)
    engine = TargetEngine(lm, max_sequences=64)
    assert engine.store.max_sequences == 2
    for name in ("a", "b", "c"):
        engine.verify(VerifyCall(name, 0, [1, 2, 3], [], [], GREEDY))
    assert "a" not in engine.store and len(engine.store) == 2
    engine.store.release("b")
    engine.verify(VerifyCall("d", 0, [4, 5], [], [], GREEDY))
    free = StaticLM(small_model().float(), torch.device("cpu"), pass_rows=4, slots=1)
    held = free.new_cache()
    with pytest.raises(Overloaded):
        free.new_cache()
    del held
    free.new_cache()


def test_a_long_prompt_is_fed_in_passes_and_bounded_by_the_context():
    lm = StaticLM(small_model(), torch.device("cpu"), pass_rows=8, slots=2, max_context=64)
    seq = Sequence("a", tokens=list(range(1, 50)))
    assert lm.forward(seq, [], keep=3).shape == (3, lm.vocab_size)
    assert seq.cached == 49 and seq.cache.length == 49
    with pytest.raises(ValueError, match="exceed"):
        lm.forward(Sequence("b", tokens=list(range(70))), [], keep=1)


def test_features_cover_every_fed_position():
    lm = lm_on(small_model(), "cpu", torch.float32)
    seq = Sequence("a", tokens=[1, 2, 3, 4])
    with lm.capturing_features() as hidden:
        lm.forward(seq, [7, 8], keep=3)
    assert hidden[0].shape == (1, 6, 64)


def test_what_runs_fixed_shape_passes():
    model = small_model()
    assert static_supported(model) is None
    assert type(exact_lm(model, torch.device("cpu"))).__name__ == "CausalLM"  # CPUs keep their own exact kernels
    model.config.hidden_act = "gelu"
    assert "activation" in static_supported(model)
    model.config.model_type = "gemma3"
    assert "not one of" in static_supported(model)


# -- real shapes on a GPU ------------------------------------------------------------------------------

@CUDA[0]
@CUDA[1]
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_real_shape_greedy_speculation_equals_decoding_alone_on_cuda(dtype):
    """SmolLM2-135M's shape with seeded random weights (near-uniform logits: near-ties everywhere)."""
    lm = exact_lm(real_shape("smollm2-135m", seed=0).to(device="cuda", dtype=dtype), torch.device("cuda"))
    assert isinstance(lm, StaticLM)
    engine = TargetEngine(lm, max_sequences=64)
    prompts = prompts_for(lm.vocab_size, 8, seed=2)
    references = [decode_alone(engine, f"r{i}", p, 32) for i, p in enumerate(prompts)]
    assert speculate(engine, prompts, references, batched=True, tree=True) == references
    assert speculate(engine, prompts[:2], references[:2], batched=False, tree=False, name="alone") == references[:2]


# Largest |logit - fp32 reference| over the largest |reference logit|, by the dtype served: fp32 on
# the GPU differs from the CPU only by summation order (and TF32 in Triton's dots), the half types by
# their rounding of every weight and activation through 30 layers.
LOGIT_TOLERANCE = {torch.float32: 5e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def relative_logit_error(model: torch.nn.Module, device: str, dtype: torch.dtype, prompt: list[int]) -> float:
    """The served exact pass on `device` in `dtype` against transformers' fp32 forward on the CPU."""
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    served = exact_lm(copy.deepcopy(model).to(device=device, dtype=dtype), torch.device(device))
    logits = served.forward(Sequence("ref", tokens=list(prompt)), [], keep=len(prompt)).float().cpu()
    return float((logits - expected).abs().max() / expected.abs().max())


def test_the_logit_error_of_the_cpus_fp32_pass_is_rounding():
    error = relative_logit_error(small_model(), "cpu", torch.float32, [5, 17, 3, 99, 42, 7] * 12)
    assert error <= 1e-5


@CUDA[0]
@CUDA[1]
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_logits_are_the_fp32_models_within_the_stated_tolerance(dtype):
    """Exactness between passes says nothing of whether a pass computes the model: this does, for
    SmolLM2-135M's shape, at every position of an 80-token prompt (two passes of 64 rows)."""
    model = real_shape("smollm2-135m", seed=0).float().eval()
    rng = random.Random(5)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(80)]
    error = relative_logit_error(model, "cuda", dtype, prompt)
    assert error <= LOGIT_TOLERANCE[dtype], f"{dtype}: max |error| / max |logit| = {error:.2e}"
