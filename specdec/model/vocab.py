"""Two tokenizers side by side: what text each token stands for, which tokens coincide, and moving
text from one vocabulary into the other.

A draft whose tokenizer differs from the target's still has to speak target ids on the wire. Text
is the common ground, but not `str`: byte-level tokens (GPT-2 style) and byte-fallback tokens
(sentencepiece style, `<0xE2>`) can each hold part of a UTF-8 character, so everything here works
on the exact bytes a token adds mid-sequence (`TokenText.pieces`), with the tokenizer markers
('Ġ', '▁') already turned back into the bytes they stand for.

- `VocabMap.draft_to_target`: the one-to-one intersection. Draft token d maps to target token t
  when both stand for the same bytes and neither vocabulary has another token for those bytes
  (special tokens only ever match special tokens of the same content). A sampling draft restricted
  to these tokens can send its p over target ids exactly, which is what keeps sampling lossless.
- `TokenText.encode`: bytes -> ids whose pieces concatenate to exactly those bytes (or None), used
  for greedy proposals and, in its lossy form, for the draft's own view of the canonical text.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for every byte, inverted: character -> byte.

    Byte-level BPE vocabularies spell tokens with these characters ('Ġ' is the space, 0x20), so a
    token string maps back to its bytes one character at a time.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def utf8_segments(data: bytes) -> list[tuple[bool, bytes]]:
    """Splits bytes into runs of valid UTF-8 (True) and stray bytes that are not (False)."""
    out: list[tuple[bool, bytes]] = []
    while data:
        try:
            data.decode("utf-8")
            out.append((True, data))
            break
        except UnicodeDecodeError as e:
            if e.start:
                out.append((True, data[: e.start]))
            out.append((False, data[e.start: e.end]))
            data = data[e.end:]
    return out


def incomplete_tail(data: bytes) -> int:
    """How many trailing bytes start a UTF-8 character that is not complete yet (0 to 3).

    Text that ends there may still grow into a character, so its last token is not settled.
    """
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: keep looking for the lead byte
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return back if need > back else 0
    return 0


def is_char_start(data: bytes | bytearray, offset: int) -> bool:
    """Whether a text could be cut at `offset` without splitting a UTF-8 character."""
    return offset <= 0 or offset >= len(data) or data[offset] & 0xC0 != 0x80


def common_prefix(a, b) -> int:
    """Length of the common prefix of two sequences (lists or bytes), by halving slice compares in C."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclasses.dataclass(frozen=True)
class TokenText:
    """What one tokenizer's tokens stand for, as bytes, and exact encoding of bytes into its ids.

    pieces[i]: the bytes token i adds when it appears mid-sequence (b"" for ids without text: the
    tokens the tokenizer puts before every text, such as <bos>, and ids past the tokenizer, such as
    a model's padding rows). Special tokens stand for their content ("<|im_end|>"): a draft reading
    a chat prompt sees the template as text, and text naming a special token encodes back to it.
    """

    tokenizer: Any
    pieces: tuple[bytes, ...]
    special: frozenset[int]
    prefix_ids: tuple[int, ...]
    byte_ids: dict[int, int]  # byte value -> the id that stands for exactly that one byte

    @classmethod
    def from_tokenizer(cls, tokenizer, size: int = 0) -> TokenText:
        """`size`: the model's vocabulary size when it has rows past the tokenizer (padding)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer; cross-vocabulary drafting needs one")
        # The decoder alone says how pieces are spelled (serialising the whole tokenizer costs seconds).
        decoder = backend.decoder.__getstate__().decode() if backend.decoder is not None else "null"
        byte_level = '"ByteLevel"' in decoder
        metaspace = '"Metaspace"' in decoder or "\u2581" in decoder or "\\u2581" in decoder
        if not (byte_level or metaspace):
            raise ValueError(f"unsupported tokenizer decoder {decoder[:120]}: need byte-level BPE or sentencepiece-style pieces")
        alphabet = byte_level_alphabet()
        added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        prefix = tuple(tokenizer("", add_special_tokens=True)["input_ids"])
        vocab = tokenizer.get_vocab()
        count = max(size, max(vocab.values()) + 1)
        pieces: list[bytes] = [b""] * count
        for token, i in vocab.items():
            if i in added:
                pieces[i] = added[i].content.encode("utf-8")
            elif byte_level:
                try:
                    pieces[i] = bytes(alphabet[c] for c in token)
                except KeyError:  # not spelled in the byte alphabet: an added-style plain string
                    pieces[i] = token.encode("utf-8")
            else:
                fallback = _BYTE_FALLBACK.fullmatch(token)
                pieces[i] = bytes([int(fallback.group(1), 16)]) if fallback else token.replace("\u2581", " ").encode("utf-8")
        for i in prefix:
            pieces[i] = b""  # put before every text by the tokenizer itself, so it stands for none
        special = frozenset(i for i, t in added.items() if t.special)
        byte_ids: dict[int, int] = {}
        for i, piece in enumerate(pieces):
            if len(piece) == 1 and i not in special:
                # Several ids may stand for one byte (sentencepiece: "a" and <0x61>); prefer the one
                # the tokenizer itself produces, so our encodings look like the tokenizer's own.
                if piece[0] not in byte_ids or _encodes_to(tokenizer, piece, i):
                    byte_ids[piece[0]] = i
        text = cls(tokenizer, tuple(pieces), special, prefix, byte_ids)
        probe = "Hello, world! héllo 😀\n\tdef f(x):  return x"
        if text.encode(probe.encode()) is None:
            raise ValueError(f"{type(tokenizer).__name__}: encoding text does not reproduce it byte for byte "
                             "(a normalizer or an added prefix space); cross-vocabulary drafting cannot align it")
        return text

    def __len__(self) -> int:
        return len(self.pieces)

    def piece(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def join(self, ids) -> bytes:
        return b"".join(self.piece(t) for t in ids)

    def encode(self, data: bytes, lossy: bool = False) -> list[int] | None:
        """Ids whose pieces concatenate to exactly `data`, as the tokenizer would split it.

        Valid UTF-8 goes through the tokenizer; stray bytes (half a character) become single-byte
        tokens. None when that cannot be done exactly (no single-byte token, a normalizer that
        rewrites the text); with `lossy`, what cannot be represented is dropped instead, which is
        good enough for a draft's view of the context (it only costs acceptance).
        """
        ids: list[int] = []
        for valid, run in utf8_segments(bytes(data)):
            if valid:
                got = self.tokenizer(run.decode("utf-8"), add_special_tokens=False)["input_ids"]
                if self.join(got) == run:
                    ids.extend(got)
                    continue
                if not lossy:
                    return None
                for char in run.decode("utf-8"):  # rare: re-encode char by char, bytes as a last resort
                    one = self.tokenizer(char, add_special_tokens=False)["input_ids"]
                    ids.extend(one if self.join(one) == char.encode() else self._bytes(char.encode(), True) or [])
            else:
                got = self._bytes(run, lossy)
                if got is None:
                    return None
                ids.extend(got)
        return ids

    def _bytes(self, run: bytes, lossy: bool) -> list[int] | None:
        if not lossy and any(b not in self.byte_ids for b in run):
            return None
        return [self.byte_ids[b] for b in run if b in self.byte_ids]


def _encodes_to(tokenizer, piece: bytes, token: int) -> bool:
    try:
        return tokenizer(piece.decode("utf-8"), add_special_tokens=False)["input_ids"] == [token]
    except UnicodeDecodeError:
        return False


@dataclasses.dataclass(frozen=True)
class VocabMap:
    """The draft's and the target's TokenText, and the one-to-one intersection of the two."""

    draft: TokenText
    target: TokenText
    draft_to_target: dict[int, int]

    @classmethod
    def build(cls, draft: TokenText, target: TokenText) -> VocabMap:
        """Raises ValueError when the vocabularies share no token: nothing could ever be accepted."""
        mapping = {}
        target_keys = _unique_keys(target)
        for key, d in _unique_keys(draft).items():
            if key in target_keys:
                mapping[d] = target_keys[key]
        if not mapping:
            raise ValueError("the draft's and the target's tokenizers share no token (no identical, unique piece of text)")
        return cls(draft, target, mapping)


def _unique_keys(text: TokenText) -> dict[tuple[bool, bytes], int]:
    """(is special, bytes) -> id, for the pieces exactly one id stands for.

    Ids that duplicate another's bytes are dropped, except that a single byte keeps the id the
    tokenizer really uses for it (byte_ids): sentencepiece's byte-fallback twin of "a" must not
    push "a" itself out of the intersection.
    """
    seen: dict[tuple[bool, bytes], int] = {}
    dup: set[tuple[bool, bytes]] = set()
    for i, piece in enumerate(text.pieces):
        if not piece:
            continue
        key = (i in text.special, piece)
        if len(piece) == 1 and not key[0]:
            if text.byte_ids.get(piece[0]) != i:
                continue
        if key in seen:
            dup.add(key)
        seen[key] = i
    return {k: i for k, i in seen.items() if k not in dup}
