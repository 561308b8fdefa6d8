from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("draft_length", "adaptive", "tree_budget", "tree_top_k", "tree_shape")
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TREE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TREE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    draft_length: int
    adaptive: bool
    tree_budget: int
    tree_top_k: int
    tree_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_length: _Optional[int] = ..., adaptive: _Optional[bool] = ..., tree_budget: _Optional[int] = ..., tree_top_k: _Optional[int] = ..., tree_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "steps", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "draft_seconds", "verify_seconds", "wire_seconds", "total_seconds", "time_to_first_token_seconds", "accepted_per_position", "wire_bytes", "draft_steps", "runahead_steps", "runahead_hits", "runahead_tokens", "runahead_used_tokens", "first_step_tokens", "load_capped_steps", "prediction_tokens", "accepted_prediction_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    RUNAHEAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    RUNAHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    RUNAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNAHEAD_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_CAPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    steps: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    draft_seconds: float
    verify_seconds: float
    wire_seconds: float
    total_seconds: float
    time_to_first_token_seconds: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    wire_bytes: int
    draft_steps: int
    runahead_steps: int
    runahead_hits: int
    runahead_tokens: int
    runahead_used_tokens: int
    first_step_tokens: int
    load_capped_steps: int
    prediction_tokens: int
    accepted_prediction_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., wire_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., wire_bytes: _Optional[int] = ..., draft_steps: _Optional[int] = ..., runahead_steps: _Optional[int] = ..., runahead_hits: _Optional[int] = ..., runahead_tokens: _Optional[int] = ..., runahead_used_tokens: _Optional[int] = ..., first_step_tokens: _Optional[int] = ..., load_capped_steps: _Optional[int] = ..., prediction_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "max_new_tokens", "sampling", "speculation", "stop", "request_id", "logprobs", "ignore_eos", "min_tokens", "prediction")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    max_new_tokens: int
    sampling: SamplingParams
    speculation: SpeculationParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    logprobs: int
    ignore_eos: bool
    min_tokens: int
    prediction: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., prediction: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stats", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "max_new_tokens", "sampling", "speculation", "stop", "request_id", "logprobs", "ignore_eos", "min_tokens", "prediction")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    max_new_tokens: int
    sampling: SamplingParams
    speculation: SpeculationParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    logprobs: int
    ignore_eos: bool
    min_tokens: int
    prediction: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., prediction: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stats", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class DraftServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftServiceGetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class TargetServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetServiceGetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context", "eos_token_ids", "device", "dtype", "drafter", "needs_features", "weights", "weight_bytes", "draft", "prefill_chunk_tokens", "numerics", "verify_knee")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_KNEE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    drafter: str
    needs_features: bool
    weights: str
    weight_bytes: int
    draft: str
    prefill_chunk_tokens: int
    numerics: str
    verify_knee: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., drafter: _Optional[str] = ..., needs_features: _Optional[bool] = ..., weights: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., draft: _Optional[str] = ..., prefill_chunk_tokens: _Optional[int] = ..., numerics: _Optional[str] = ..., verify_knee: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "rows", "dim", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    dim: int
    data: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sequence_id", "known_len", "append_tokens", "max_tokens", "min_cumulative_prob", "temperature", "seed", "features")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_CUMULATIVE_PROB_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    known_len: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    min_cumulative_prob: float
    temperature: float
    seed: int
    features: Features
    def __init__(self, sequence_id: _Optional[str] = ..., known_len: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., min_cumulative_prob: _Optional[float] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class ProposeSessionRequest(_message.Message):
    __slots__ = ("propose",)
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    propose: ProposeRequest
    def __init__(self, propose: _Optional[_Union[ProposeRequest, _Mapping]] = ...) -> None: ...

class ProposeSessionResponse(_message.Message):
    __slots__ = ("tokens", "compute_seconds")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[ProposeResponse]
    compute_seconds: float
    def __init__(self, tokens: _Optional[_Iterable[_Union[ProposeResponse, _Mapping]]] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_id", "dist", "cumulative_prob", "compute_seconds")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DIST_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_PROB_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    dist: SparseDistribution
    cumulative_prob: float
    compute_seconds: float
    def __init__(self, token_id: _Optional[int] = ..., dist: _Optional[_Union[SparseDistribution, _Mapping]] = ..., cumulative_prob: _Optional[float] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class DraftsRequest(_message.Message):
    __slots__ = ("propose", "release")
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    propose: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, propose: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftsResponse(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("sequence_id", "proposal", "error_code", "error_message")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    proposal: ProposeSessionResponse
    error_code: int
    error_message: str
    def __init__(self, sequence_id: _Optional[str] = ..., proposal: _Optional[_Union[ProposeSessionResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class VerifySessionRequest(_message.Message):
    __slots__ = ("verify",)
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    verify: VerifyRequest
    def __init__(self, verify: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class VerifySessionResponse(_message.Message):
    __slots__ = ("verify",)
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    verify: VerifyResponse
    def __init__(self, verify: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[DecodeRun]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, start: _Optional[_Iterable[_Union[DecodeRun, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeRun(_message.Message):
    __slots__ = ("sequence_id", "known_len", "append_tokens", "sampling", "max_new_tokens", "stop_token_ids", "eos_banned_until", "logprobs", "lookup_max_tokens", "lookup_costs", "lookup_source", "draft_length", "adaptive", "seeded", "features", "overlap", "report_every")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EOS_BANNED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_COSTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    REPORT_EVERY_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    known_len: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    eos_banned_until: int
    logprobs: int
    lookup_max_tokens: int
    lookup_costs: _containers.RepeatedScalarFieldContainer[float]
    lookup_source: _containers.RepeatedScalarFieldContainer[int]
    draft_length: int
    adaptive: bool
    seeded: bool
    features: bool
    overlap: bool
    report_every: int
    def __init__(self, sequence_id: _Optional[str] = ..., known_len: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., eos_banned_until: _Optional[int] = ..., logprobs: _Optional[int] = ..., lookup_max_tokens: _Optional[int] = ..., lookup_costs: _Optional[_Iterable[float]] = ..., lookup_source: _Optional[_Iterable[int]] = ..., draft_length: _Optional[int] = ..., adaptive: _Optional[bool] = ..., seeded: _Optional[bool] = ..., features: _Optional[bool] = ..., overlap: _Optional[bool] = ..., report_every: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[DecodeProgress]
    def __init__(self, runs: _Optional[_Iterable[_Union[DecodeProgress, _Mapping]]] = ...) -> None: ...

class DecodeProgress(_message.Message):
    __slots__ = ("sequence_id", "tokens", "logprobs", "passes", "drafted", "accepted", "prediction_drafted", "prediction_accepted", "compute_seconds", "done", "error_code", "error_message")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    passes: int
    drafted: int
    accepted: int
    prediction_drafted: int
    prediction_accepted: int
    compute_seconds: float
    done: bool
    error_code: int
    error_message: str
    def __init__(self, sequence_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., passes: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., prediction_drafted: _Optional[int] = ..., prediction_accepted: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., done: _Optional[bool] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("sequence_id", "known_len", "append_tokens", "draft_tokens", "draft_dists", "sampling", "draft_tree", "return_features", "decode_ahead", "logprobs", "eos_banned_until", "lookup_max_tokens", "lookup_costs", "decode_ahead_passes", "lookup_source")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TREE_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EOS_BANNED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_COSTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_PASSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    known_len: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_dists: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    sampling: SamplingParams
    draft_tree: DraftTree
    return_features: bool
    decode_ahead: int
    logprobs: int
    eos_banned_until: int
    lookup_max_tokens: int
    lookup_costs: _containers.RepeatedScalarFieldContainer[float]
    decode_ahead_passes: int
    lookup_source: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[str] = ..., known_len: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_dists: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., draft_tree: _Optional[_Union[DraftTree, _Mapping]] = ..., return_features: _Optional[bool] = ..., decode_ahead: _Optional[int] = ..., logprobs: _Optional[int] = ..., eos_banned_until: _Optional[int] = ..., lookup_max_tokens: _Optional[int] = ..., lookup_costs: _Optional[_Iterable[float]] = ..., decode_ahead_passes: _Optional[int] = ..., lookup_source: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("parents", "tokens", "child_dists")
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHILD_DISTS_FIELD_NUMBER: _ClassVar[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    child_dists: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    def __init__(self, parents: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., child_dists: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ...) -> None: ...

class TreeParams(_message.Message):
    __slots__ = ("budget", "top_k", "shape", "max_depth")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    budget: int
    top_k: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    max_depth: int
    def __init__(self, budget: _Optional[int] = ..., top_k: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., max_depth: _Optional[int] = ...) -> None: ...

class ProposeTreeRequest(_message.Message):
    __slots__ = ("sequence_id", "known_len", "append_tokens", "tree", "temperature", "seed", "features")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    known_len: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    tree: TreeParams
    temperature: float
    seed: int
    features: Features
    def __init__(self, sequence_id: _Optional[str] = ..., known_len: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[TreeParams, _Mapping]] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class ProposeTreeResponse(_message.Message):
    __slots__ = ("tree", "compute_seconds")
    TREE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTree
    compute_seconds: float
    def __init__(self, tree: _Optional[_Union[DraftTree, _Mapping]] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "next_token", "compute_seconds", "cached_len", "accepted_path", "features", "decoded_tokens", "logprobs", "ahead_passes", "ahead_drafted", "ahead_accepted", "prediction_drafted", "prediction_accepted", "ahead_seconds", "ahead_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    DECODED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_PASSES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    compute_seconds: float
    cached_len: int
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    features: Features
    decoded_tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    ahead_passes: int
    ahead_drafted: int
    ahead_accepted: int
    prediction_drafted: int
    prediction_accepted: int
    ahead_seconds: float
    ahead_tokens: int
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., cached_len: _Optional[int] = ..., accepted_path: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., decoded_tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., ahead_passes: _Optional[int] = ..., ahead_drafted: _Optional[int] = ..., ahead_accepted: _Optional[int] = ..., prediction_drafted: _Optional[int] = ..., prediction_accepted: _Optional[int] = ..., ahead_seconds: _Optional[float] = ..., ahead_tokens: _Optional[int] = ...) -> None: ...

class DraftServiceReleaseRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class DraftServiceReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TargetServiceReleaseRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class TargetServiceReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
