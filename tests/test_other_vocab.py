"""Drafts with another tokenizer: the vocabulary mapping, greedy equality through gRPC, and the
intersection rule's losslessness when sampling.

The tiny pair has deliberately different tokenizers: the target speaks the byte tokenizer of
specdec_tools.tinymodels (one token per byte), the draft a byte-level BPE with merges trained here with
the `tokenizers` library, whose ids are ordered differently (so an identity mapping would be
wrong). The draft's weights are the noisy tiny draft's, moved to its own ids: single-byte tokens
take their byte's rows, merges the rows of their bytes (slightly favoured, so the draft does
propose multi-byte tokens that must be re-cut into target bytes). It therefore agrees with the
target often but not always, and both directions are tested through the real servers.
"""

from __future__ import annotations

import collections

import pytest
import torch
from scipy import stats
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from draft_service.drafters.other_vocab import CrossVocabDrafter, build_cross_drafter
from draft_service.drafters.base import Drafter
from specdec.calls.request import ProposeCall
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig, derive_seed, target_probs
from specdec.model.vocab import TokenText, VocabMap, common_prefix, incomplete_tail, utf8_segments
from specdec.calls.request import VerifyCall
from target_service.engine import TargetEngine
from tests import tiny
from tests.stack import Stack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW = 16
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on and on.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; i++) {\n\tprintf(\"%d\\n\", i);\n}\n",
    "Grüße aus München! Ça va très bien, merci. 東京は晴れです。 😀 🚀",
    "    indented    text   with   runs     of      spaces\n\n\n   and newlines",
]
TEXT_PROMPTS = [
    "Hello, world!", "The quick brown fox", "  leading spaces", "trailing spaces   ", "tabs\tand\ttabs",
    "def add(a, b):\n    return a + b\n", "if (x > 0) { return x; }", "import torch\nx = torch.zeros(3)",
    "Grüße aus München", "Ça va très bien", "東京は晴れです", "emoji 😀🚀 party", "naïve café résumé",
    "\n\n\n", "     ", "a  b   c    d", "<eos> is just text here", "1234567890 + 42 = ?", "SELECT * FROM t;",
    "x", "the the the the", "Über\tdas\n  Wetter 🌧️", "λx. x + 1 → ∞", "print('hi')  # comment",
]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with ~90 merges; <eos> comes first, so its ids differ from the byte tokenizer's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=350, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def move_vocab(model: LlamaForCausalLM, src: TokenText, dst_tok, merge_bias: float = 1.03) -> LlamaForCausalLM:
    """The same network over another vocabulary: each new token takes the rows of its bytes' tokens."""
    dst = TokenText.from_tokenizer(dst_tok)
    size = len(dst) + (-len(dst)) % 4  # a few padding rows, as real models have
    config = model.config.__class__(**{**model.config.to_dict(), "vocab_size": size})
    config.eos_token_id = config.pad_token_id = dst_tok.eos_token_id
    moved = LlamaForCausalLM(config).eval()
    state = {k: v for k, v in model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    moved.load_state_dict(state, strict=False)
    src_ids = {piece: i for i, piece in enumerate(src.pieces) if piece}
    src_eos = model.config.eos_token_id
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        new_emb, new_head = moved.get_input_embeddings().weight, moved.get_output_embeddings().weight
        new_head[len(dst):] = 0
        for j, piece in enumerate(dst.pieces):
            if j == dst_tok.eos_token_id:
                new_emb[j], new_head[j] = emb[src_eos], head[src_eos]
            elif piece in src_ids:
                new_emb[j], new_head[j] = emb[src_ids[piece]], head[src_ids[piece]]
            elif piece:  # a merge: read like its last byte, predicted like its first (a little more)
                new_emb[j] = emb[src_ids[piece[-1:]]]
                new_head[j] = head[src_ids[piece[:1]]] * merge_bias
    moved.generation_config.eos_token_id = moved.generation_config.pad_token_id = dst_tok.eos_token_id
    return moved


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(byte target, BPE draft) and (BPE target, byte draft), saved with their tokenizers."""
    target, draft = tiny.tiny_pair(seed=0)
    byte_text = TokenText.from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB)
    bpe = bpe_tokenizer()
    folder = tmp_path_factory.mktemp("cross")
    bpe_draft = move_vocab(draft, byte_text, bpe)
    bpe_target = move_vocab(target, byte_text, bpe, merge_bias=1.0)
    paths = {"byte_target": tiny.save(target, folder / "byte_target"), "byte_draft": tiny.save(draft, folder / "byte_draft")}
    for name, model in (("bpe_draft", bpe_draft), ("bpe_target", bpe_target)):
        model.save_pretrained(folder / name)
        bpe.save_pretrained(folder / name)
        paths[name] = str(folder / name)
    return {"target": target, "draft": draft, "bpe_target": bpe_target, "bpe_draft": bpe_draft, "bpe": bpe, "paths": paths}


# -- the mapping -------------------------------------------------------------------------------------

def test_token_text_pieces_round_trip_every_encoding(pair):
    for tok, size in ((tiny.byte_tokenizer(), tiny.VOCAB), (pair["bpe"], 0)):
        text = TokenText.from_tokenizer(tok, size)
        for prompt in TEXT_PROMPTS + CORPUS:
            ids = text.encode(prompt.encode())
            assert ids == tok(prompt, add_special_tokens=False)["input_ids"], prompt
            assert text.join(ids) == prompt.encode()
            assert tok.decode(ids) == prompt


def test_partial_utf8_becomes_single_byte_tokens():
    text = TokenText.from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB)
    emoji = "😀".encode()
    assert utf8_segments(b"a" + emoji[:2] + b"b") == [(True, b"a"), (False, emoji[:2]), (True, b"b")]
    assert incomplete_tail(b"x" + emoji[:3]) == 3 and incomplete_tail(b"x" + emoji) == 0 and incomplete_tail(b"\xff") == 0
    ids = text.encode(b"ok" + emoji[:2])
    assert text.join(ids) == b"ok" + emoji[:2] and len(ids) == 4


def test_intersection_is_one_to_one_over_identical_bytes(pair):
    byte_text = TokenText.from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB)
    bpe_text = TokenText.from_tokenizer(pair["bpe"])
    vmap = VocabMap.build(bpe_text, byte_text)
    mapping = vmap.draft_to_target
    assert len(set(mapping.values())) == len(mapping) == 257  # every byte, and <eos> to <eos>
    for d, t in mapping.items():
        assert bpe_text.pieces[d] == byte_text.pieces[t]
        assert (d in bpe_text.special) == (t in byte_text.special)
    assert mapping[pair["bpe"].eos_token_id] == tiny.EOS
    assert any(d != t for d, t in mapping.items())  # the ids really differ
    merges = [i for i, p in enumerate(bpe_text.pieces) if len(p) > 1 and i not in bpe_text.special]
    assert merges and not set(merges) & set(mapping)  # multi-byte tokens have no partner


def test_no_shared_vocabulary_is_a_clear_error():
    byte_text = TokenText.from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB)
    tok = Tokenizer(models.BPE(vocab={"ab": 0, "<s>": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with pytest.raises(ValueError, match="share no token|does not reproduce"):
        VocabMap.build(TokenText.from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok)), byte_text)


def test_unloadable_target_tokenizer_is_a_clear_error(pair, tmp_path):
    lm = CausalLM(pair["bpe_draft"], torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_cross_drafter(lm, pair["bpe"], "draft", str(tmp_path / "missing.gguf"), 8)
    with pytest.raises(ValueError, match="has none"):
        build_cross_drafter(lm, None, "draft", pair["paths"]["byte_target"], 8)


def test_identical_vocabularies_keep_the_plain_model_drafter(pair):
    """`specdec up` passes the target's tokenizer for any other draft model; one that shares it
    needs no mapping."""
    lm = CausalLM(pair["draft"], torch.device("cpu"))
    assert build_cross_drafter(lm, tiny.byte_tokenizer(), "draft", pair["paths"]["byte_target"], 8) is None
    assert build_cross_drafter(lm, pair["bpe"], "draft", pair["paths"]["byte_target"], 8) is not None


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and common_prefix(b"abc", b"abc") == 3 and common_prefix([], [1]) == 0
    assert all(common_prefix(list(range(n)) + [7], list(range(n)) + [8]) == n for n in range(40))


# -- the drafter's state -------------------------------------------------------------------------------

def cross_engine(pair, top_k: int = 8) -> DraftEngine:
    vmap = VocabMap.build(TokenText.from_tokenizer(pair["bpe"], pair["bpe_draft"].config.vocab_size),
                          TokenText.from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB))
    return DraftEngine(CrossVocabDrafter(CausalLM(pair["bpe_draft"], torch.device("cpu")), vmap, top_k))


def test_it_is_a_drafter_that_neither_reads_features_nor_branches(pair):
    drafter = cross_engine(pair).drafter
    assert isinstance(drafter, Drafter)
    assert (drafter.kind, drafter.vocab_size, drafter.needs_features, drafter.inline, drafter.source) == ("model", 0, False, False, None)
    assert not drafter.batches(ProposeCall("s", 0, [], 4))


def test_draft_state_is_the_draft_tokenization_and_keeps_its_cache(pair):
    """After rollbacks and catch-ups the draft's tokens spell the canonical text, and its KV cache
    gives the same next-token logits as a fresh forward over them."""
    engine = cross_engine(pair)
    drafter = engine.drafter
    byte_tok, bpe = tiny.byte_tokenizer(), pair["bpe"]
    canonical = byte_tok("The quick brown fox 😀 def f(x):", add_special_tokens=False)["input_ids"]
    list(engine.propose(ProposeCall("s", 0, canonical, 6)))
    rng = torch.Generator().manual_seed(3)
    for step in range(12):
        known = len(canonical) - int(torch.randint(0, 4, (1,), generator=rng))
        canonical = canonical[:known] + torch.randint(0, 256, (3,), generator=rng).tolist()
        if step % 4 == 0:  # sometimes text the BPE merges ("the ")
            canonical += byte_tok(" the fox", add_special_tokens=False)["input_ids"]
        proposals = list(engine.propose(ProposeCall("s", known, canonical[known:], 5)))
        seq = engine.store._sequences["s"]
        state = drafter.state(seq)
        text = drafter.vocab.target.join(canonical + [p.token for p in proposals])
        assert bytes(state.text) == text
        assert drafter.vocab.draft.join(state.draft.tokens) == bytes(state.draft_text)
        assert bytes(state.draft_text) == text
        cached = state.draft.cached
        assert cached < len(state.draft.tokens)
        with torch.inference_mode():
            fresh = pair["bpe_draft"](torch.tensor([state.draft.tokens])).logits[0, -1]
        torch.testing.assert_close(drafter.lm.forward(state.draft, keep=1)[0], fresh, atol=1e-4, rtol=1e-4)
    ids = bpe(" the fox", add_special_tokens=False)["input_ids"]
    assert len(ids) < len(" the fox")  # the BPE really merges: the state is not byte tokens in disguise


def test_target_ids_without_text_add_nothing_to_the_draft_context(pair):
    """Padding rows past the target's tokenizer (and ids no tokenizer knows) are valid target output."""
    engine = cross_engine(pair)
    a, b, c = (tiny.byte_tokenizer().convert_tokens_to_ids(ch) for ch in "ABC")
    list(engine.propose(ProposeCall("z", 0, [a, b], 3)))
    list(engine.propose(ProposeCall("z", 2, [tiny.VOCAB - 1, -5, 10**6, c], 3, 0.0, 1.0, 1)))
    state = engine.drafter.state(engine.store._sequences["z"])
    assert bytes(state.text).startswith(b"AB") and bytes(state.text)[2:3] == b"C"


# -- greedy through gRPC -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env(pair):
    stack = Stack()
    paths = pair["paths"]
    byte_target = stack.target(paths["byte_target"])
    bpe_target = stack.target(paths["bpe_target"])
    bpe_draft = stack.draft(drafter="model", model=paths["bpe_draft"], target_tokenizer=paths["byte_target"])
    byte_draft = stack.draft(drafter="model", model=paths["byte_draft"], target_tokenizer=paths["bpe_target"])
    clients = {
        "bpe_drafts_bytes": stack.client(stack.coordinator(byte_target, bpe_draft, tiny.byte_tokenizer())),
        "byte_drafts_bpe": stack.client(stack.coordinator(bpe_target, byte_draft, pair["bpe"])),
    }
    yield {"clients": clients, "stack": stack}
    stack.stop()


def generate(client, prompt: list[int], **kwargs) -> pb.GenerateResponse:
    speculation = {k: kwargs.pop(k) for k in ("draft_length", "adaptive") if k in kwargs}
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW,
                                 speculation=pb.SpeculationParams(**speculation), **kwargs)
    return client.Generate(request, timeout=60)


@pytest.mark.parametrize("direction", ["bpe_drafts_bytes", "byte_drafts_bpe"])
def test_greedy_cross_vocabulary_draft_matches_target_generate(pair, env, direction):
    target, tok = (pair["target"], tiny.byte_tokenizer()) if direction == "bpe_drafts_bytes" else (pair["bpe_target"], pair["bpe"])
    totals = collections.Counter()
    # All prompts one way (Unicode, code, whitespace runs); a third of them the other way, for time.
    for i, text in enumerate(TEXT_PROMPTS if direction == "bpe_drafts_bytes" else TEXT_PROMPTS[::3]):
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        expected = tiny.reference_greedy(target, prompt, MAX_NEW) if direction == "bpe_drafts_bytes" else _reference(target, prompt, tok.eos_token_id)
        response = generate(env["clients"][direction], prompt, draft_length=(4, 8, 2)[i % 3], adaptive=False)
        assert list(response.token_ids) == expected, text
        totals["drafted"] += response.stats.draft_tokens
        totals["accepted"] += response.stats.accepted_tokens
    print(f"{direction}: accepted {totals['accepted']} of {totals['drafted']} drafted")
    assert 0 < totals["accepted"] < totals["drafted"]  # real speculation: accepts and rejects


@torch.inference_mode()
def _reference(model, prompt: list[int], eos: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def test_seeded_sampling_through_grpc_repeats_exactly(env):
    client = env["clients"]["bpe_drafts_bytes"]
    prompt = tiny.prompts()[1]
    sampling = pb.SamplingParams(temperature=1.0, top_k=20, seed=7)
    first = generate(client, prompt, sampling=sampling, draft_length=4, adaptive=False)
    second = generate(client, prompt, sampling=sampling, draft_length=4, adaptive=False)
    assert list(first.token_ids) == list(second.token_ids) and first.stats.draft_tokens > 0


def test_draft_service_frees_sequences_and_speaks_target_ids(env):
    servers = env["stack"].servers
    for server in servers[2:4]:
        assert len(server.servicer.engine.store) == 0
        assert server.servicer.host.info.vocab_size == 0  # no draft vocabulary for the coordinator to check


# -- sampling: the intersection rule is lossless --------------------------------------------------------

SAMPLES, FALSE_ALARM = 2_000, 1e-4


def test_intersection_rule_samples_exactly_the_target_distribution(pair):
    """First two emitted tokens follow the target's warped distribution (chi-square per position).

    The BPE draft puts much of its mass on merges, which it may not propose (no one-to-one target
    token); masking them keeps p exact, so rejection sampling stays lossless.
    """
    target_model = pair["target"]
    target = TargetEngine(CausalLM(target_model, torch.device("cpu")))
    draft = cross_engine(pair, top_k=6)
    sampling_base = dict(temperature=0.9, top_k=8, top_p=0.95)
    prompt = tiny.prompts()[1]  # random bytes: the BPE reads them byte by byte, as the target does
    draft_prompt = draft.drafter.vocab.draft.encode(bytes(prompt))
    assert len(draft_prompt) == len(prompt)
    with torch.inference_mode():
        draft_logits = pair["bpe_draft"](torch.tensor([draft_prompt])).logits[0, -1]
    assert not draft.drafter.allowed[draft_logits.topk(6).indices].all()  # merges in its top-k: the mask matters
    first, second, accepted_total, drafted_total = [], [], 0, 0
    for seed in range(SAMPLES):
        sampling = SamplingConfig(seed=seed, **sampling_base)
        proposals = list(draft.propose(ProposeCall("s", 0, prompt, 2, 0.0, sampling.temperature, derive_seed(seed, len(prompt), "draft"))))
        for p in proposals:
            ids, probs = p.dist
            assert len(ids) == len(probs) and abs(sum(probs) - 1) < 1e-5 and p.token in ids
        tokens = [p.token for p in proposals]
        result = target.verify(VerifyCall("s", 0, prompt, tokens, [p.dist for p in proposals], sampling))
        emitted = tokens[: result.accepted] + [result.next_token]
        accepted_total += result.accepted
        drafted_total += len(tokens)
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append((emitted[0], emitted[1]))
    with torch.inference_mode():
        q0 = target_probs(target_model(torch.tensor([prompt])).logits[0, -1], SamplingConfig(**sampling_base))
    print(f"accepted {accepted_total} of {drafted_total} drafted")
    assert 0.1 * drafted_total < accepted_total < 0.95 * drafted_total
    assert chi_square_pvalue(first, q0) > FALSE_ALARM
    top_first = collections.Counter(f for f, _ in second).most_common(1)[0][0]
    with torch.inference_mode():
        q1 = target_probs(target_model(torch.tensor([prompt + [top_first]])).logits[0, -1], SamplingConfig(**sampling_base))
    conditioned = [s for f, s in second if f == top_first]
    assert len(conditioned) > 100
    assert chi_square_pvalue(conditioned, q1) > FALSE_ALARM


def chi_square_pvalue(tokens: list[int], q: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=q.shape[-1]).double()
    support = q > 0
    assert counts[~support].sum() == 0, "a token outside the target's top-k / top-p support was emitted"
    kept = q[support].double()
    expected = kept / kept.sum() * counts[support].sum()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)
