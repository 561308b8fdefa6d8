"""HTTP request bodies parsed without holding the event loop, and bounded by what they hold.

Why: the body cap (--max-body-bytes, 16 MiB) bounds bytes, not work. Parsed and validated on the
event loop, a 16 MiB body of token ids (`"prompt": [[1],[1],...]`, 4M entries) stalled /health and
every other client for seconds, and millions of stop strings for a noticeable while. So a body past
LARGE_BODY_BYTES is parsed in a separate process (pydantic's parser holds the GIL: a thread would
stall the loop all the same), and every body is then checked against the bounds of what a request
may hold (token ids against --max-prompt-tokens, stop strings, chat messages) before anything else
touches it; only a body inside them comes back to the loop, so what the loop unpickles is small.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import multiprocessing

from pydantic import BaseModel, ValidationError

from specdec.errors import InvalidArgument

LARGE_BODY_BYTES = 256 * 1024  # below this, parsing takes a few milliseconds at most: done in place
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 65536  # all stop strings together
MAX_MESSAGES = 4096  # chat messages in one request, and prompts in a batch


class InvalidBody(Exception):
    """The body is not the model: pydantic's errors (as `ValidationError.errors()` lists them)."""

    def __init__(self, errors: list[dict]):
        super().__init__(errors[0]["msg"] if errors else "invalid body")
        self.errors = errors


def oversized(body: BaseModel, max_prompt_tokens: int) -> tuple[str, str] | None:
    """(field, why) when the body holds more than a request may, else None."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        ids = sum(len(p) if isinstance(p, list) else 1 for p in prompt)
        if ids > max_prompt_tokens:
            return "prompt", f"{ids} token ids, more than --max-prompt-tokens={max_prompt_tokens}"
    # a flat list of ids is one prompt (OpenAI's API), bounded by its ids above and by the context later
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > MAX_MESSAGES:
        return "prompt", f"{len(prompt)} prompts; at most {MAX_MESSAGES}"
    messages = getattr(body, "messages", None)
    if messages is not None and len(messages) > MAX_MESSAGES:
        return "messages", f"{len(messages)} messages; at most {MAX_MESSAGES}"
    stop = getattr(body, "stop", None)
    if isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            return "stop", f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}"
        chars = sum(len(s) for s in stop)
        if chars > MAX_STOP_CHARS:
            return "stop", f"stop strings of {chars} characters in all; at most {MAX_STOP_CHARS}"
    return None


def _parse(model: type[BaseModel], data: bytes, max_prompt_tokens: int) -> tuple[str, object]:
    """In this process or the parser's: ("ok", body), ("invalid", errors) or ("oversized", (field, why))."""
    try:
        body = model.model_validate_json(data)
    except ValidationError as exc:
        return "invalid", exc.errors(include_url=False, include_context=False, include_input=False)
    problem = oversized(body, max_prompt_tokens)
    return ("oversized", problem) if problem else ("ok", body)


_pool: concurrent.futures.ProcessPoolExecutor | None = None


def _parser() -> concurrent.futures.ProcessPoolExecutor:
    """One parser process, started on the first large body ("spawn": a fork of a process running
    gRPC's threads is unsafe)."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_pool.shutdown, cancel_futures=True)  # before interpreter teardown, which it outlived
    return _pool


async def parse(model: type[BaseModel], data: bytes, max_prompt_tokens: int) -> BaseModel:
    """The body as `model`, parsed off the event loop when large; raises InvalidBody (400 naming the
    field) or InvalidArgument (a body past a bound, naming the field)."""
    if len(data) <= LARGE_BODY_BYTES:
        kind, value = _parse(model, data, max_prompt_tokens)
    else:  # the model class travels by its importable name
        kind, value = await asyncio.get_running_loop().run_in_executor(_parser(), _parse, model, data, max_prompt_tokens)
    if kind == "invalid":
        raise InvalidBody(value)
    if kind == "oversized":
        raise InvalidArgument(*value)
    return value
