from coordinator.text import TextStream
from tests.tiny import byte_tokenizer


def feed(stream, pieces_of_tokens):
    out = []
    for i, tokens in enumerate(pieces_of_tokens):
        piece, keep = stream.add(tokens, final=i == len(pieces_of_tokens) - 1)
        out.append((piece, keep))
    return out


def test_multibyte_characters_are_never_split():
    tok = byte_tokenizer()
    ids = tok("héllo 世界", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, [])
    pieces = feed(stream, [[t] for t in ids])
    assert "".join(p for p, _ in pieces) == "héllo 世界"
    assert all("\ufffd" not in p for p, _ in pieces)


def test_stop_string_is_cut_and_never_streamed_in_part():
    tok = byte_tokenizer()
    ids = tok("one two STOP three", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, ["STOP"])
    emitted, kept = "", 0
    for token in ids:
        piece, keep = stream.add([token], final=False)
        emitted += piece
        kept += keep
        assert "S" not in emitted  # not even the start of the stop string leaks out
        if stream.stopped_at is not None:
            break
    assert emitted == "one two " and stream.final_text == "one two "
    assert kept == len(tok("one two STOP", add_special_tokens=False)["input_ids"])


def _metaspace_tokenizer():
    """A sentencepiece-style tokenizer ('▁' marks spaces, the decoder strips the first one): the
    kind whose text is not the concatenation of its tokens' texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld, 世界 and   spaces", "def f(x):\n    return x * 2"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def test_incremental_text_equals_one_full_decode():
    import random

    rng = random.Random(0)
    for tok in (byte_tokenizer(), _metaspace_tokenizer()):
        texts = ["the quick brown fox", "héllo wörld 世界", "def f(x):\n    return x * 2", "  leading   spaces  "]
        for text in texts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            for _ in range(5):  # arbitrary step sizes, as speculation yields 1..g+1 tokens per step
                stream, pieces, i = TextStream(tok, []), [], 0
                while i < len(ids):
                    n = rng.randint(1, 4)
                    piece, _ = stream.add(ids[i : i + n], final=i + n >= len(ids))
                    pieces.append(piece)
                    i += n
                assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True), (text, pieces)
        random_ids = [rng.randrange(tok.vocab_size) for _ in range(300)]  # invalid byte runs included
        stream = TextStream(tok, [])
        out = "".join(stream.add([t], final=k == len(random_ids) - 1)[0] for k, t in enumerate(random_ids))
        assert out == tok.decode(random_ids, skip_special_tokens=True)


def test_decoding_work_per_step_does_not_grow_with_the_output():
    tok = byte_tokenizer()
    calls = []
    original = tok.decode

    def counting(ids, **kwargs):
        calls.append(len(ids))
        return original(ids, **kwargs)

    tok.decode = counting
    stream = TextStream(tok, ["never"])
    for token in tok("abcdefghij" * 100, add_special_tokens=False)["input_ids"]:
        stream.add([token], final=False)
    assert max(calls) <= 4  # a window of a few tokens, not the whole 1000-token output
