"""Text in and out: prompts to token ids, and generated ids to text as they stream, with stop strings.

Streaming text must never show half a UTF-8 character (byte-level tokens split them) nor the start
of a stop string that is about to match, so `TextStream` holds those back until they are settled,
and the concatenation of every piece it emits equals the final text.

Decoding is incremental (as in TGI and vLLM): each step decodes only the tokens since the last
settled point, plus the few before it as context, and keeps the part past that context's text.
Re-decoding the whole output every step would cost O(n) per token, O(n^2) per request.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # no stop string ends the text before this many tokens (as vLLM)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the decoded text of tokens[:_read] (before any stop cut)
        self.emitted = 0  # characters of text already handed out
        self.stopped_at: int | None = None  # character index where a stop string starts
        self._prefix = 0  # tokens[_prefix:_read] is the context the next decode starts from
        self._read = 0  # tokens whose text is settled in self.text

    def add(self, tokens: list[int], final: bool) -> tuple[str, int]:
        """Adds tokens; returns (text safe to emit now, how many of `tokens` to keep).

        Tokens past the one that completed a stop string are dropped: the second element says how
        many of the given tokens belong to the output.
        """
        keep = len(tokens)
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            if self.stop:
                self._decode(final=final and i == len(tokens) - 1)
                match = self._find_stop() if len(self.tokens) >= self.min_tokens else None
                if match is not None:
                    self.stopped_at, keep = match, i + 1
                    break
        if not self.stop:
            self._decode(final)
        return self._flush(final or self.stopped_at is not None), keep

    def _decode(self, final: bool) -> None:
        """Appends the text of the unsettled tokens. Text that ends in an incomplete UTF-8 sequence
        (U+FFFD from the decoder) stays unsettled until its remaining bytes arrive, or the end."""
        if self._read == len(self.tokens):
            return
        decode = self.tokenizer.decode
        start = self._prefix
        context = decode(self.tokens[start : self._read], skip_special_tokens=True)
        while not context and start > 0:  # skipped special tokens give no context: a decoder that
            start -= 1  # strips the first token's leading space ('▁') would then strip a real one
            context = decode(self.tokens[start : self._read], skip_special_tokens=True)
        window = decode(self.tokens[start:], skip_special_tokens=True)
        if window.endswith("\ufffd") and not final:
            return
        if not window.startswith(context):  # a tokenizer whose text is not prefix-stable: decode it all
            full = decode(self.tokens, skip_special_tokens=True)
            if full.startswith(self.text):
                self.text = full
            else:
                self.text += window[len(context) :]
        else:
            self.text += window[len(context) :]
        self._prefix, self._read = self._read, len(self.tokens)

    def _find_stop(self) -> int | None:
        window_start = max(0, self.emitted - self.hold - 1)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        return min(hits) if hits else None

    def _flush(self, final: bool) -> str:
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        if not final:
            end = min(end, len(self.text) - self.hold)
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:end], end
        return piece

    @property
    def final_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at]
