"""The HTTP API's replies in OpenAI's shapes: a whole completion or its chunks as server-sent events
(Reply), log-probabilities (Logprobs), usage, and the request's speculation statistics; a stream
that ends when its client stops reading (StallingStream).

Apart from http.py (the routes) because the shapes are OpenAI's contract, read and tested on their own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from fastapi.responses import StreamingResponse

from coordinator.http_errors import failed
from specdec.errors import SpecdecError

log = structlog.get_logger(__name__)

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def speculation_json(s) -> dict:
    """The loop's Stats as JSON: what speculation did for this request."""
    return {
        "steps": s.steps, "draft_steps": s.draft_steps, "load_capped_steps": s.load_capped_steps, "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 4),
        "accepted_per_position": list(s.accepted_per_position), "draft_seconds": round(s.draft_seconds, 6),
        "verify_seconds": round(s.verify_seconds, 6), "wire_seconds": round(s.wire_seconds, 6),
        "time_to_first_token_seconds": round(s.time_to_first_token_seconds, 6), "first_step_tokens": s.first_step_tokens,
        "total_seconds": round(s.total_seconds, 6),
        "runahead_steps": s.runahead_steps, "runahead_hits": s.runahead_hits, "runahead_tokens": s.runahead_tokens,
        "runahead_used_tokens": s.runahead_used_tokens,
        "prediction_tokens": s.prediction_tokens, "accepted_prediction_tokens": s.accepted_prediction_tokens,
    }


def usage_json(stats) -> dict:
    """OpenAI's usage; with a prediction that drafted, its completion_tokens_details too: the
    prediction's tokens the target accepted, and those it drafted and rejected."""
    usage = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
             "total_tokens": stats.prompt_tokens + stats.completion_tokens}
    if stats.prediction_tokens:
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.prediction_tokens - stats.accepted_prediction_tokens}
    return usage


# JSON has no -Infinity, the log-probability of an alternative that top-k or top-p removed: it is
# written as this floor, as OpenAI's API and vLLM write it.
LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class Logprobs:
    """Turns the target's TokenLogprobs into OpenAI's two shapes (completions and chat)."""

    def __init__(self, tokenizer, chat: bool, offset: int = 0):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, offset

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def json(self, logprobs) -> dict | None:
        if self.chat:
            content = []
            for lp in logprobs:
                text = self._text(lp.token_id)
                tops = [{"token": (t := self._text(i)), "logprob": _logprob(v), "bytes": list(t.encode("utf-8"))} for i, v in lp.top]
                content.append({"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode("utf-8")),
                                "top_logprobs": tops})
            return {"content": content}
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(self._text(lp.token_id))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        tops = [{self._text(i): _logprob(v) for i, v in lp.top} for lp in logprobs]
        return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in logprobs], "top_logprobs": tops,
                "text_offset": offsets}


class StallingStream(StreamingResponse):
    """Server-sent events that end when the client stops reading, as --stream-stall-timeout-s ends a
    gRPC stream: a send that TCP flow control holds past `stall_timeout_s` closes the events' iterator
    (which cancels the request, freeing its running slot and both services' sequences) and leaves the
    response unfinished: uvicorn then closes the connection without the chunked body's last chunk, so
    the client sees a broken response, not a whole one (no middleware may finish it: Authenticate).
    0: wait as long as the client does."""

    def __init__(self, content, stall_timeout_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if not self.stall_timeout_s:
            return await super().__call__(scope, receive, send)
        stalled = False

        async def timed(message) -> None:
            nonlocal stalled
            if stalled:
                return  # nothing more goes to a client that stopped reading
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                stalled = True
                log.warning("ending a stream whose client stopped reading", stall_timeout_s=self.stall_timeout_s)
                await self.body_iterator.aclose()

        await super().__call__(scope, receive, timed)


class Reply:
    """One response's ids and shapes: a whole completion, or its chunks as server-sent events."""

    def __init__(self, ident: str, created: int, model: str, chat: bool, logprobs: Logprobs | None, echo: str):
        self.ident, self.created, self.model, self.chat, self.logprobs, self.echo = ident, created, model, chat, logprobs, echo

    def _envelope(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    def whole(self, chunks) -> dict:
        last = chunks[-1]
        text = self.echo + "".join(c.text for c in chunks)
        lps = self.logprobs.json([lp for c in chunks for lp in c.logprobs]) if self.logprobs else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH[last.finish], "logprobs": lps}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice],
                              usage=usage_json(last.stats), speculation=speculation_json(last.stats))

    def _chunk(self, text: str | None, finish: str | None, logprobs=(), role: bool = False, **extra) -> str:
        lps = self.logprobs.json(logprobs) if self.logprobs and logprobs else None
        reason = FINISH.get(finish) if finish else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": reason}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {json.dumps(self._envelope(kind, [choice], **extra))}\n\n"

    async def events(self, first, steps, include_usage: bool):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. With
        stream_options.include_usage, a last chunk with empty `choices` carries the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            yield self._chunk(None, None, role=True)
        elif self.echo:
            yield self._chunk(self.echo, None)
        chunk = first
        try:
            while chunk is not None:
                if chunk.text or chunk.logprobs:
                    yield self._chunk(chunk.text, None, chunk.logprobs)
                if chunk.finish:
                    yield self._chunk(None, chunk.finish, speculation=speculation_json(chunk.stats))
                    if include_usage:
                        yield f"data: {json.dumps(self._envelope(kind, [], usage=usage_json(chunk.stats)))}\n\n"
                    break
                try:
                    chunk = await steps.__anext__()
                except StopAsyncIteration:
                    chunk = None
                except SpecdecError as exc:
                    body = json.loads(failed(exc).body)
                    yield f"data: {json.dumps(body)}\n\n"
                    break
        finally:
            await steps.aclose()
        yield "data: [DONE]\n\n"
