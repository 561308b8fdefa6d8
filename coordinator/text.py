"""Text in and out: prompts to token ids, and generated ids to text as they stream, with stop strings.

Streaming text must never show half a UTF-8 character (byte-level tokens split them) nor the start
of a stop string that is about to match, so `TextStream` holds those back until they are settled,
and the concatenation of every piece it emits equals the final text.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the full decoded text so far (before any stop cut)
        self.emitted = 0  # characters of text already handed out
        self.stopped_at: int | None = None  # character index where a stop string starts

    def add(self, tokens: list[int], final: bool) -> tuple[str, int]:
        """Adds tokens; returns (text safe to emit now, how many of `tokens` to keep).

        Tokens past the one that completed a stop string are dropped: the second element says how
        many of the given tokens belong to the output.
        """
        keep = len(tokens)
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            if self.stop:
                self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
                match = self._find_stop()
                if match is not None:
                    self.stopped_at, keep = match, i + 1
                    break
        if not self.stop:
            self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._flush(final or self.stopped_at is not None), keep

    def _find_stop(self) -> int | None:
        window_start = max(0, self.emitted - self.hold - 1)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        return min(hits) if hits else None

    def _flush(self, final: bool) -> str:
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        if not final:
            end = min(end, len(self.text) - self.hold)
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1  # an incomplete UTF-8 sequence: wait for the rest of its bytes
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:end], end
        return piece

    @property
    def final_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at]
