"""The one place a generation request becomes a validated GenerationSpec.

The gRPC API hands its GenerateRequest (or GenerateStreamRequest) here; the HTTP API translates
OpenAI JSON into the same GenerateRequest (coordinator/http.py) and comes here too, so both APIs
accept and refuse the same requests with the same messages. Every refusal is an InvalidArgument
naming the request field as google.rpc.BadRequest does ("sampling.top_p", "stop[2]"); the checks
run in field order, so the first bad field is the one named. Bounds come from specdec/limits.py
(the gRPC contract) and the coordinator's config (this deployment's limits and defaults).
"""

from __future__ import annotations

import hmac
import random
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.protocol import GenerationSpec
from protos import specdec_pb2 as pb
from specdec.errors import InvalidArgument
from specdec.limits import MAX_DRAFT_TOKENS, MAX_LOGPROBS, MAX_LOOKUP_SOURCE, MAX_REQUEST_ID
from specdec.calls.checks import check_token_ids
from specdec.calls.request import TreeSettings
from specdec.maths.tree import check_tree_bounds
from specdec.maths.sampling import SamplingConfig, check_sampling

CHAT_ROLES = ("system", "user", "assistant")
TREE_FIELDS = {"budget": "speculation.tree_budget", "top_k": "speculation.tree_top_k", "shape": "speculation.tree_shape"}

Request = pb.GenerateRequest | pb.GenerateStreamRequest


def generation_spec(request: Request, config: CoordinatorConfig, tokenizer, target: pb.ModelInfo) -> tuple[GenerationSpec, list[str]]:
    """(the validated spec, the stop strings) for `request` against `config` and the target it runs on;
    raises InvalidArgument naming the first bad field."""
    # A prompt must leave room for one generated token in the target's context.
    limit = min(config.max_prompt_tokens, target.max_context - 1) if target.max_context else config.max_prompt_tokens
    prompt_ids = prompt_tokens(request, tokenizer, target.vocab_size, limit, config.max_prompt_chars)
    max_new = max_new_tokens(request, config, len(prompt_ids), target.max_context)
    sampling, seeded = sampling_config(request.sampling)
    draft_length, adaptive, tree = speculation(request.speculation, config)
    stop = stop_strings(request.stop)
    check_request_id(request.request_id)
    logprobs, min_tokens = output_options(request, max_new)
    prediction = prediction_tokens(request, tokenizer, config.max_prompt_chars)
    spec = GenerationSpec(
        request_id=request.request_id or uuid.uuid4().hex[:16],
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        sampling=sampling,
        draft_length=draft_length,
        adaptive=adaptive,
        eos_token_ids=frozenset() if request.ignore_eos else frozenset(target.eos_token_ids),
        seeded=seeded,
        max_context=target.max_context,
        tree=tree if logprobs is None and not min_tokens else None,  # the target reports and bans on chains only
        logprobs=logprobs,
        min_tokens=min_tokens,
        prediction_ids=prediction,
    )
    return spec, stop


def prediction_tokens(request: Request, tokenizer, max_chars: int) -> tuple[int, ...]:
    """The predicted output's target token ids (bounded before and after tokenizing, as a prompt is)."""
    if not request.prediction:
        return ()
    if max_chars and len(request.prediction) > max_chars:
        raise InvalidArgument("prediction", f"{len(request.prediction)} characters, more than --max-prompt-chars={max_chars}")
    ids = _tokenize(tokenizer, request.prediction)
    if len(ids) > MAX_LOOKUP_SOURCE:
        raise InvalidArgument("prediction", f"{len(ids)} tokens, more than {MAX_LOOKUP_SOURCE}")
    return tuple(ids)


# --- the prompt: one of text, token_ids or chat, in the target's token ids ---


def _text_ids(request: Request, tokenizer, vocab: int) -> Sequence[int]:
    if not request.text:
        raise InvalidArgument("text", "the prompt is empty")
    return _tokenize(tokenizer, request.text)


def _tokenize(tokenizer, text: str) -> list[int]:
    # Only the ids: each other list (attention mask, type ids) costs a pass holding the GIL on a long text.
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def _token_ids(request: Request, tokenizer, vocab: int) -> Sequence[int]:
    ids = list(request.token_ids.ids)
    check_token_ids("token_ids", ids, vocab)  # the target's own check: the same refusal from either
    return ids


def _chat_ids(request: Request, tokenizer, vocab: int) -> Sequence[int]:
    messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    if not messages:
        raise InvalidArgument("chat.messages", "the conversation is empty")
    if any(m["role"] not in CHAT_ROLES for m in messages):
        raise InvalidArgument("chat.messages.role", "each role must be system, user or assistant")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("chat", "the target's tokenizer has no chat template; send text or token_ids")
    ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding regardless
        ids = ids["input_ids"]
    return ids


PROMPTS: dict[str, Callable[[Request, Any, int], Sequence[int]]] = {"text": _text_ids, "token_ids": _token_ids, "chat": _chat_ids}


def check_prompt_chars(request: Request, which: str, max_chars: int) -> None:
    """Refuses a text or chat prompt longer than `max_chars` (0: no limit) before it is tokenized:
    tokenizing takes time in proportion to the text, and a text this long cannot be within the
    token limit, so the work would be wasted (--max-prompt-chars)."""
    if not max_chars or which not in ("text", "chat"):
        return
    chars = len(request.text) if which == "text" else sum(len(m.content) for m in request.chat.messages)
    if chars > max_chars:
        field = "text" if which == "text" else "chat.messages"
        raise InvalidArgument(field, f"the prompt has {chars} characters, more than the limit of {max_chars}", "context_length_exceeded")


def prompt_tokens(request: Request, tokenizer, vocab: int, limit: int, max_chars: int = 0) -> list[int]:
    """The prompt in the target's token ids: at least one, at most `limit`; a text or chat prompt
    at most `max_chars` characters (0: no limit), checked first."""
    which = request.WhichOneof("prompt")
    encode = PROMPTS.get(which or "")
    if encode is None:
        raise InvalidArgument("prompt", "set one of text, token_ids or chat")
    check_prompt_chars(request, which, max_chars)
    ids = [int(t) for t in encode(request, tokenizer, vocab)]
    if not ids:
        raise InvalidArgument(which, "the prompt has no tokens")
    if len(ids) > limit:
        raise InvalidArgument(which, f"the prompt has {len(ids)} tokens, more than the limit of {limit}", "context_length_exceeded")
    return ids


# --- how much to generate, and how ---


def max_new_tokens(request: Request, config: CoordinatorConfig, prompt_len: int, context: int) -> int:
    """max_new_tokens (or the default), inside the coordinator's limit and the target's context (0: unbounded)."""
    if request.HasField("max_new_tokens"):
        max_new = request.max_new_tokens
    else:  # the default, within the context the prompt leaves
        max_new = config.default_max_new_tokens
        if context:
            max_new = max(1, min(max_new, context - prompt_len))
    if not 1 <= max_new <= config.max_new_tokens:
        raise InvalidArgument("max_new_tokens", f"must be in [1, {config.max_new_tokens}], got {max_new}")
    if context and prompt_len + max_new > context:
        raise InvalidArgument("max_new_tokens", f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) "
                                                f"exceeds the target's context of {context}", "context_length_exceeded")
    return max_new


def sampling_config(s: pb.SamplingParams) -> tuple[SamplingConfig, bool]:
    """(the sampling settings, whether the client chose the seed); unset fields mean greedy, no top-k or top-p."""
    temperature = s.temperature if s.HasField("temperature") else 0.0
    top_k = s.top_k if s.HasField("top_k") else 0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    seeded = s.HasField("seed")
    seed = s.seed if seeded else random.getrandbits(63)
    return check_sampling(SamplingConfig(temperature, top_k, top_p, seed)), seeded


def speculation(sp: pb.SpeculationParams, config: CoordinatorConfig) -> tuple[int, bool, TreeSettings | None]:
    """(draft length, adaptive, tree settings or None for chains); unset fields take the config's defaults."""
    draft_length = sp.draft_length if sp.HasField("draft_length") else config.draft_length
    if not 0 <= draft_length <= MAX_DRAFT_TOKENS:
        raise InvalidArgument("speculation.draft_length", f"must be in [0, {MAX_DRAFT_TOKENS}], got {draft_length}")
    adaptive = sp.adaptive if sp.HasField("adaptive") else config.adaptive
    return draft_length, adaptive, tree_settings(sp, config, draft_length)


def tree_settings(sp: pb.SpeculationParams, config: CoordinatorConfig, draft_length: int) -> TreeSettings | None:
    """Draft trees when the budget and the draft length are both non-zero; None drafts chains."""
    budget = sp.tree_budget if sp.HasField("tree_budget") else config.tree_budget
    top_k = sp.tree_top_k if sp.HasField("tree_top_k") else config.tree_top_k
    shape = tuple(sp.tree_shape) or config.parsed_tree_shape()
    check_tree_bounds(budget, top_k, shape, TREE_FIELDS, min_budget=0)  # budget 0: chains
    return TreeSettings(budget, top_k, shape) if budget and draft_length else None


# --- what ends generation, what the response reports, and what names the request ---


def output_options(request: Request, max_new: int) -> tuple[int | None, int]:
    """(logprobs: None or the alternatives per token, min_tokens)."""
    logprobs = request.logprobs if request.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidArgument("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if not 0 <= request.min_tokens <= max_new:
        raise InvalidArgument("min_tokens", f"must be in [0, max_new_tokens = {max_new}], got {request.min_tokens}")
    return logprobs, request.min_tokens


def stop_strings(stop: Sequence[str]) -> list[str]:
    for i, s in enumerate(stop):
        if not s:
            raise InvalidArgument(f"stop[{i}]", "stop strings must not be empty")
    return list(stop)


def bearer(header: str) -> str | None:
    """The credentials of an `authorization` value in the Bearer scheme, else None. The scheme's name
    is case-insensitive (RFC 7235 2.1): `bearer x` is `Bearer x`."""
    scheme, _, credentials = header.strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def token_matches(header: str, token: str) -> bool:
    """Whether an `authorization` value carries the API token, compared in constant time. As bytes:
    a header may hold any character (HTTP gives latin-1), which must be a refusal, never an error."""
    given = bearer(header) or ""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))


def check_request_id(request_id: str) -> None:
    # It travels in gRPC metadata to the backends, which carries printable ASCII only.
    if len(request_id) > MAX_REQUEST_ID or not all(" " <= c <= "~" for c in request_id):
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID} printable ASCII characters")
