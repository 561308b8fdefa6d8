"""Coordinator configuration: flags, or SPECDEC_COORDINATOR_* environment variables."""

from __future__ import annotations

import dataclasses

from specdec.limits import MAX_DECODE_AHEAD, MAX_STREAM_INTERVAL, MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_TOP_K
from coordinator.loop import DEFAULT_DECODE_AHEAD
from specdec.serving.config import (backend_token_option, check_backend_token, event_loop_option, log_format_option,
                                    log_level_option, option)
from specdec.model.loading import DEFAULT_TARGET

ENV_PREFIX = "SPECDEC_COORDINATOR_"


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """The public API: drives draft -> verify -> rollback for every request."""

    host: str = option("127.0.0.1", "Address to listen on (0.0.0.0 in a container).")
    port: int = option(50051, "Port to listen on; 0 picks a free one.")
    http_port: int = option(8000, "Port of the OpenAI-compatible HTTP API, /health and /metrics; 0 picks a free one, -1 disables it.")
    api_token: str = option("", "Bearer token the public APIs require (gRPC metadata `authorization` and HTTP); empty: open.")
    target: str = option(
        "127.0.0.1:50052",
        "Address of the target service; replicas: a comma-separated list or a dns:/// name resolving to each "
        "(a headless Service), each sequence's calls kept on one replica by consistent hashing.",
    )
    draft: str = option(
        "127.0.0.1:50053",
        "Address of the draft service (replicas as for --target); `ngram`: prompt lookup inside the coordinator (no draft service, no "
        "draft round trip); empty turns speculation off.",
    )
    tokenizer: str = option(DEFAULT_TARGET, "Tokenizer of the target model: alias, hub id, folder or .gguf file.")
    served_model_name: str = option(
        "",
        "Model ids the HTTP API lists in /v1/models and accepts in `model`, comma-separated (a request naming "
        "another gets 404); empty: the --tokenizer value.",
    )
    draft_length: int = option(8, "Default upper bound on draft tokens per step (requests may ask for another, up to 32).")
    adaptive: bool = option(True, "Adapt the draft length per request unless the request says otherwise.")
    decode_ahead: int = option(
        DEFAULT_DECODE_AHEAD,
        "When the coordinator will not draft for the next steps (speculation off, an n-gram draft resting "
        "after empty asks, drafting not paying), the target decodes up to this many of them in the same "
        "Verify exchange; tokens then stream in bursts of up to N+1 (with --lookup-ahead, of up to N+1 passes' "
        "tokens). A request answered whole (unary Generate, HTTP without stream, no stop strings) decodes "
        "all its tokens in its prompt's exchange. 0 turns it off.",
    )
    lookup_ahead: bool = option(
        True,
        "With the n-gram drafter, the target drafts by prompt lookup itself (the same rule, each match's "
        "draft cut by the measured costs) on every pass, and decodes up to --decode-ahead passes ahead in "
        "the same exchange: an n-gram step then costs no exchange with the draft service. Greedy output is "
        "unchanged; seeded sampling still asks the draft service each step.",
    )
    decode_runs: bool = option(
        True,
        "A request whose passes need no draft service (speculation off, no draft asked, or prompt lookup in the "
        "target with --lookup-ahead) is one run in the target, which decodes it to its end and streams its tokens "
        "after every pass, on one Decode stream shared by all requests: no exchange between passes. Off: one "
        "Verify exchange per --decode-ahead passes. Not for a fleet of target replicas.",
    )
    stream_interval: int = option(
        1,
        "With --decode-runs, the target sends a run's tokens in bursts of N (the first token at once, the end "
        "whenever it comes), and each burst is one message to the client: under many streams, fewer messages "
        "a token for the target, the coordinator and the client (as vLLM's --stream-interval), at the cost "
        "of tokens arriving N at a time. 1: after every pass.",
    )
    overlap: str = option(
        "off",
        "Overlapped speculation: while the target verifies a step, the draft drafts the next one ahead, "
        "assuming full acceptance. on, off, or auto (per request, only while the hits it observes pay for the"
        " misses). Pays when draft and target run on separate hardware.",
        choices=("off", "auto", "on"),
    )
    tree_budget: int = option(
        0,
        "Default draft tree budget: most nodes the target verifies per step, the draft length capping their "
        "depth (requests may ask for another, up to 64); 0: chains.",
    )
    tree_top_k: int = option(4, "Children per expanded node, and nodes expanded per level, of a dynamic draft tree (1 to 16).")
    tree_shape: str = option(
        "",
        "A static draft tree instead: children per node at each depth, comma-separated (e.g. 4,2,2,1); empty:"
        " dynamic.",
    )
    max_new_tokens: int = option(4096, "Largest max_new_tokens a request may ask for.")
    default_max_new_tokens: int = option(128, "max_new_tokens when a request leaves it unset.")
    max_prompt_tokens: int = option(
        32768, "Longest prompt accepted, in target tokens; the target's context (less one generated token) bounds it too.")
    max_prompt_chars: int = option(
        1_000_000,
        "Longest text prompt (or chat messages' total) in characters, checked before tokenizing: tokenizing "
        "costs time in proportion to the text, so a text far past --max-prompt-tokens is refused without "
        "paying for it. The default is about 30 characters per token of the default --max-prompt-tokens, "
        "several times the 3 to 5 that text averages, so in practice it refuses only prompts that could not "
        "fit anyway; raise it with --max-prompt-tokens. 0: no limit.",
    )
    max_body_bytes: int = option(
        16 * 1024 * 1024,
        "Largest HTTP request body; a larger one gets 413 before it is read (Content-Length) or as soon as "
        "it passes the limit (chunked). The default holds a prompt of --max-prompt-chars characters even "
        "written as JSON escapes (up to 12 bytes a character), or --max-prompt-tokens token ids, with room to spare.",
    )
    max_streams_per_client: int = option(
        0,
        "Concurrent requests (running and queued) one client may have; past it RESOURCE_EXHAUSTED. A client is "
        "its --client-id-header value when set, else its IP address (the port left out): never the bearer "
        "token, which every client of --api-token shares and anyone can make up. 0: --max-concurrent-requests "
        "(no limit when that is 0), so no client holds more than the running slots.",
    )
    client_id_header: str = option(
        "",
        "Request header (HTTP) and metadata key (gRPC) naming the client for --max-streams-per-client, e.g. "
        "x-client-id. Only for a gateway in front that sets it on every request (and drops a client's own): "
        "anyone reaching the coordinator directly can send any value. Requests without it count by IP "
        "address. Empty: by IP address.",
    )
    max_concurrent_requests: int = option(
        32,
        "Requests running at once (each is a row of the target's batch); more wait in the queue. 0: no limit.",
    )
    stream_stall_timeout_s: float = option(
        30.0,
        "End a GenerateStream, or an HTTP stream of server-sent events, whose next message could not be written "
        "for this long (a client that stopped reading: flow control holds the write), freeing its running slot "
        "and its sequences (gRPC: CANCELLED; HTTP: the connection is dropped); "
        "0: wait up to the request's deadline.",
    )
    http_header_timeout_s: float = option(
        10.0,
        "Close an HTTP connection whose request head (request line and headers) has not arrived this long after "
        "it opened or after its last response (slowloris: clients that trickle header bytes to hold connections); "
        "0: no deadline.",
    )
    max_connections_per_client: int = option(
        256, "Most HTTP connections one client address holds open at once; past it a new one is closed at once. 0: no cap.")
    max_num_partial_prefills: int = option(
        1,
        "Prompts longer than the target's prefill chunk (its --max-prefill-tokens-per-pass) admitted and not yet "
        "at their first token, at most; more wait in the queue without a running slot, and shorter requests behind "
        "them start first (vLLM's flag of this name). 0: no bound.",
    )
    max_long_partial_prefills: int = option(
        1,
        "Of those, prompts longer than --long-prefill-token-threshold, at most: a flood of long prompts is "
        "prefilled one after another, in the order it came, and cannot hold every running slot. 0: no bound.",
    )
    long_prefill_token_threshold: int = option(
        0, "A prompt longer than this is long (--max-long-partial-prefills); 0: 4 percent of the target's context, as vLLM.")
    max_queue: int = option(64, "Requests waiting for a running slot; past it RESOURCE_EXHAUSTED at once, with a retry-after hint.")
    verify_token_budget: int = option(
        -2,
        "Verified positions per target pass the running requests share: each drafts at most budget // running"
        " - 1 tokens, none once the batch is full (the response statistics count those steps: "
        "load_capped_steps). -2: the target's knee, timed at its start-up on its device (ModelInfo.verify_knee: "
        "the most positions a pass verifies before it costs 1.5 times one; 8 from a target that does not "
        "report one); -1: the same rule over the costs this coordinator measures (noisy on a busy machine); "
        "0: no load cap; N: N. The target's own lookup drafts (--lookup-ahead) are cut by what their "
        "positions add to its batched pass instead.",
    )
    rpc_timeout_s: float = option(
        30.0, "Deadline of each call to the draft and target services; a call that feeds a long prompt gets this "
        "much per 256 prompt tokens (the target feeds it in chunks between other sequences' steps).")
    target_retry_s: float = option(
        10.0,
        "How long Verify is retried while the target answers UNAVAILABLE (a restart), never past the "
        "request's deadline; then the request fails UNAVAILABLE.",
    )
    startup_timeout_s: float = option(600.0, "How long to wait for the draft and target to come up.")
    tls_cert: str = option("", "PEM certificate this server presents; with --tls-key turns TLS on.")
    tls_key: str = option("", "PEM private key of --tls-cert.")
    tls_ca: str = option("", "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).")
    backend_tls_ca: str = option("", "PEM CA that signed the draft's and target's certificates; when set, calls to them use TLS.")
    backend_tls_cert: str = option("", "PEM client certificate presented to the draft and target (mutual TLS).")
    backend_tls_key: str = option("", "PEM private key of --backend-tls-cert.")
    backend_token: str = backend_token_option(
        "the coordinator sends it (metadata `authorization: Bearer <token>`) on every call to its target and draft. "
        "Its own APIs are --api-token's.")
    grace_s: float = option(10.0, "Seconds in-flight requests get to finish after SIGTERM.")
    event_loop: str = event_loop_option()
    log_format: str = log_format_option()
    log_level: str = log_level_option()

    def __post_init__(self):
        check_backend_token(self.backend_token)
        if not 0 <= self.decode_ahead <= MAX_DECODE_AHEAD:
            raise ValueError(f"--decode-ahead must be in [0, {MAX_DECODE_AHEAD}], got {self.decode_ahead}")
        if self.verify_token_budget < -2:
            raise ValueError(f"--verify-token-budget must be >= -2, got {self.verify_token_budget}")
        for flag in ("max_concurrent_requests", "max_queue", "target_retry_s", "max_streams_per_client",
                     "stream_stall_timeout_s", "max_prompt_chars", "http_header_timeout_s", "max_connections_per_client",
                     "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold"):
            if not getattr(self, flag) >= 0:  # NaN too
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(self, flag)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if not 0 <= self.tree_budget <= MAX_TREE_NODES:
            raise ValueError(f"--tree-budget must be in [0, {MAX_TREE_NODES}], got {self.tree_budget}")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"--stream-interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}")
        if not 1 <= self.tree_top_k <= MAX_TREE_TOP_K:
            raise ValueError(f"--tree-top-k must be in [1, {MAX_TREE_TOP_K}], got {self.tree_top_k}")
        self.parsed_tree_shape()  # raises for a malformed shape
        if self.client_id_header and not all(c.isascii() and (c.isalnum() or c in "-_.") for c in self.client_id_header):
            raise ValueError(f"--client-id-header must be a header name (letters, digits, '-', '_', '.'), got {self.client_id_header!r}")

    def streams_per_client(self) -> int:
        """The per-client cap in force (0: none): --max-streams-per-client, else the running slots."""
        return self.max_streams_per_client or self.max_concurrent_requests

    def model_names(self) -> list[str]:
        """The ids the HTTP API serves (--served-model-name, else --tokenizer), the first one shown."""
        return [n.strip() for n in self.served_model_name.split(",") if n.strip()] or [self.tokenizer]

    def parsed_tree_shape(self) -> tuple[int, ...]:
        try:
            shape = tuple(int(part) for part in self.tree_shape.split(",") if part.strip())
        except ValueError:
            raise ValueError(f"--tree-shape must be comma-separated integers, got {self.tree_shape!r}") from None
        if len(shape) > MAX_TREE_DEPTH or any(not 1 <= width <= MAX_TREE_TOP_K for width in shape):
            raise ValueError(f"--tree-shape: at most {MAX_TREE_DEPTH} levels of 1 to {MAX_TREE_TOP_K} children, got {self.tree_shape!r}")
        return shape
