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
