"""The OpenAI-compatible API's requests and responses, as pydantic models.

Every field OpenAI defines for /v1/completions and /v1/chat/completions is here, either honoured or
refused with a 400 that names it (`refuse_unsupported`): a client in JSON mode, or with tools, must
learn that it did not get what it asked for, not receive prose. Fields no one defines are refused
too (extra="forbid"), as OpenAI does: a typo such as `max_token` must not pass silently. Validation
is strict (no "1" for 1) and bounded by the protobuf fields the request becomes, so an integer too
large for them is a 400, never a 500.

Extensions, as vLLM names them: top_k, min_tokens, ignore_eos; and speculation's own: draft_length,
adaptive.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protos import specdec_pb2 as pb
from specdec.errors import InvalidArgument
from specdec.limits import MAX_LOGPROBS

INT32 = 2**31 - 1
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32)]
Count = Annotated[int, Field(ge=0, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]

# What each GenerateRequest field is called in the OpenAI request, for errors the shared validator
# (coordinator/validate.py) raises: a client must read the name it sent.
JSON_NAMES = {
    "text": "prompt", "token_ids": "prompt", "prompt": "prompt", "chat": "messages", "chat.messages": "messages",
    "chat.messages.role": "messages.role", "max_new_tokens": "max_tokens", "sampling.temperature": "temperature",
    "sampling.top_k": "top_k", "sampling.top_p": "top_p", "sampling.seed": "seed", "speculation.draft_length": "draft_length",
    "request_id": "X-Request-Id", "logprobs": "logprobs", "min_tokens": "min_tokens",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="Send a last chunk with the usage and empty `choices`.")


class Sampling(Strict):
    """The fields both endpoints share."""

    model: str | None = Field(None, description="One of /v1/models' ids; unset: the served model.")
    max_tokens: Count | None = Field(None, description="Most tokens to generate.")
    temperature: Annotated[Finite, Field(ge=0)] | None = Field(None, description="0: greedy. Default 1, as OpenAI.")
    top_p: Finite | None = Field(None, description="Nucleus sampling, in (0, 1].")
    n: Annotated[int, Field(ge=1, le=INT32)] = Field(1, description="Only 1.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Stop strings: the text is cut before the first one.")
    seed: Seed | None = Field(None, description="Makes sampling reproducible (same seed, same tokens).")
    presence_penalty: Finite = Field(0.0, description="Only 0: penalties would change the target's distribution.")
    frequency_penalty: Finite = Field(0.0, description="Only 0.")
    logit_bias: dict[str, Finite] | None = Field(None, description="Only empty.")
    user: str | None = Field(None, description="Accepted and ignored, as an end-user label.")
    top_k: Annotated[int, Field(ge=-1, le=INT32)] | None = Field(
        None, description="Extension: keep the k most likely tokens; 0 or -1: off.")
    min_tokens: Count = Field(0, description="Extension: no end-of-sequence token or stop string before this many tokens.")
    ignore_eos: bool = Field(False, description="Extension: generate max_tokens tokens, past end-of-sequence tokens.")
    draft_length: Count | None = Field(None, description="Extension: most draft tokens per step (0: speculation off).")
    adaptive: bool | None = Field(None, description="Extension: adapt the draft length to the acceptance seen.")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(description="One prompt: text or token ids.")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="Return each token's log-probability and this many alternatives.")
    echo: bool = Field(False, description="Put the prompt before the completion.")
    best_of: Annotated[int, Field(ge=1, le=INT32)] | None = Field(None, description="Only 1.")
    suffix: str | None = Field(None, description="Only empty (no insertion).")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class TextContent(Strict):
    """Content given as a string or as text parts (a message's, a prediction's)."""

    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatMessage(TextContent):
    role: Literal["system", "developer", "user", "assistant"]
    name: str | None = None


class Prediction(TextContent):
    type: Literal["content"]


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = Field(None, description="Most tokens to generate (max_tokens' newer name).")
    logprobs: bool = Field(False, description="Return each token's log-probability.")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(None, description="Alternatives per token (needs logprobs).")
    response_format: ResponseFormat | None = Field(None, description="Only text: the output is not constrained.")
    tools: list[dict[str, Any]] | None = Field(None, description="Only none: no tool calling.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only none.")
    parallel_tool_calls: bool | None = None
    # what the official clients send where a program sets them (OpenAI keeps stored completions)
    store: bool | None = Field(None, description="Only false: nothing is stored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored: it labels stored completions, and none are stored.")
    prediction: Prediction | None = Field(
        None, description="Predicted output (text much of the answer repeats, as code being edited): where the target "
                          "drafts by prompt lookup, it drafts from this text too. The tokens are the target's own either way.")


def refuse_unsupported(body: Sampling) -> None:
    """400 for a field set to what specdec cannot do, naming it."""
    if body.n != 1:
        raise InvalidArgument("n", "only n = 1 is supported")
    if body.presence_penalty or body.frequency_penalty:
        raise InvalidArgument("presence_penalty" if body.presence_penalty else "frequency_penalty",
                              "penalties are not supported: they would change the target's distribution")
    if body.logit_bias:
        raise InvalidArgument("logit_bias", "is not supported")
    if isinstance(body, CompletionRequest):
        _refuse_unsupported_completion(body)
    if isinstance(body, ChatCompletionRequest):
        _refuse_unsupported_chat(body)


def _refuse_unsupported_completion(body: CompletionRequest) -> None:
    if body.best_of not in (None, 1):
        raise InvalidArgument("best_of", "only best_of = 1 is supported")
    if body.suffix:
        raise InvalidArgument("suffix", "is not supported")
    if body.echo and body.logprobs is not None:
        raise InvalidArgument("echo", "echo with logprobs is not supported (the prompt's log-probabilities are not computed)")
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list)) and len(body.prompt) != 1:
        raise InvalidArgument("prompt", "one prompt per request")


def _refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidArgument("response_format", f"{body.response_format.type} is not supported: the output is not constrained")
    if body.tools:
        raise InvalidArgument("tools", "tool calling is not supported")
    if body.tool_choice not in (None, "none"):
        raise InvalidArgument("tool_choice", "tool calling is not supported")
    if body.store:
        raise InvalidArgument("store", "storing completions is not supported")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidArgument("max_completion_tokens", "send max_tokens or max_completion_tokens, not both")


def to_generate_request(body: CompletionRequest | ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    """The GenerateRequest the gRPC API would take: one validator checks both (coordinator/validate.py)."""
    refuse_unsupported(body)
    request = pb.GenerateRequest(request_id=request_id, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)
    if isinstance(body, ChatCompletionRequest):
        for message in body.messages:
            role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for it
            request.chat.messages.add(role=role, content=message.text())
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.logprobs:
            request.logprobs = body.top_logprobs or 0
        if body.prediction is not None:
            request.prediction = body.prediction.text()
    else:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch of one
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default for completions
        if body.logprobs is not None:
            request.logprobs = body.logprobs
    if max_tokens is not None:
        request.max_new_tokens = max_tokens
    s = request.sampling
    s.temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:  # 0 and vLLM's -1 mean off
        s.top_k = body.top_k
    if body.seed is not None:
        s.seed = body.seed
    request.stop.extend([body.stop] if isinstance(body.stop, str) else (body.stop or []))
    if body.draft_length is not None:
        request.speculation.draft_length = body.draft_length
    if body.adaptive is not None:
        request.speculation.adaptive = body.adaptive
    return request


# --- responses (documented in /openapi.json; built as dicts for speed) ---


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="With a prediction that drafted: its tokens the target accepted, and those it rejected.")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: dict[str, Any] = Field(description="Extension: what speculation did for this request.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: dict[str, Any]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorBody
