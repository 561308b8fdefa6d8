"""Draft service configuration: flags, or SPECDEC_DRAFT_* environment variables."""

from __future__ import annotations

import dataclasses

from specdec.model.cpu import gemm
from specdec.serving.config import (backend_token_option, check_backend_token, check_static, compute_threads_option,
                                    check_weights, event_loop_option, log_format_option, log_level_option, numerics_option,
                                    option, static_options, weights_option)

ENV_PREFIX = "SPECDEC_DRAFT_"


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Hosts the draft model (or an n-gram drafter) and proposes tokens."""

    host: str = option("127.0.0.1", "Address to listen on (0.0.0.0 in a container).")
    port: int = option(50053, "Port to listen on; 0 picks a free one.")
    metrics_port: int = option(8003, "Port of the Prometheus /metrics endpoint; 0 picks a free one, -1 disables it.")
    drafter: str = option("ngram", "ngram (prompt lookup, no weights) or model (a small causal LM, --model).", choices=("ngram", "model"))
    model: str = option("", "Draft model for --drafter model: alias, hub id, local folder or .gguf file.")
    device: str = option("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N.")
    dtype: str = option("auto", "auto (fp32 on CPU, bf16/fp16 on GPU), float32, float16 or bfloat16.")
    target_tokenizer: str = option(
        "",
        "Tokenizer of the target when it differs from the draft model's (alias, hub id, folder or .gguf): the"
        " draft then maps between the two vocabularies; empty: the same vocabulary.",
    )
    top_k: int = option(32, "When sampling, the draft draws from its top-k tokens so the sparse p it sends is exact.")
    ngram_max: int = option(4, "Longest suffix n-gram the n-gram drafter looks up.")
    ngram_min: int = option(1, "Shortest suffix n-gram it accepts as a match.")
    staged: bool = option(
        False,
        "Staged drafting for --drafter model, greedy: an n-gram index guesses the draft model's own next "
        "tokens and one draft forward checks them (same tokens, fewer draft passes).",
    )
    packed_gemm_rows: int = option(
        gemm.DEFAULT_ROWS,
        "CPU float32 model drafts: forwards over 1..N positions use specdec's GEMM kernel, compiled on first "
        "use (small forwards cost less than with the stock kernel); 0 turns it off.",
    )
    weights: str = weights_option(draft=True)
    compute_threads: int = compute_threads_option()
    numerics: str = numerics_option()
    pass_rows: int = static_options()[0]
    static_slots: int = static_options()[1]
    static_context: int = static_options()[2]
    batch_window_ms: float = option(
        2.0,
        "How long a drafting step waits for the other streams' steps to share its forward pass (continuous "
        "batching of model drafts); 0: no wait.",
    )
    max_batch_size: int = option(16, "Most sequences drafted in one forward pass; 1 turns draft batching off.")
    max_batch_tokens: int = option(
        256,
        "Most padded positions (rows x longest row's new tokens) in one draft pass: long catch-ups run alone.",
    )
    max_prefill_tokens_per_pass: int = option(
        256,
        "Chunked catch-up: a stream with more pending tokens than this (a long prompt) feeds this many a batched "
        "pass, with the other streams' steps between two chunks; 0: all at once.",
    )
    max_sequences: int = option(256, "Sequences held at once; past it the least recently used is evicted.")
    idle_timeout_s: float = option(600.0, "Free a sequence untouched this long; 0 disables.")
    tls_cert: str = option("", "PEM certificate this server presents; with --tls-key turns TLS on.")
    tls_key: str = option("", "PEM private key of --tls-cert.")
    tls_ca: str = option("", "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).")
    backend_token: str = backend_token_option(
        "the draft refuses every call but health checks that lacks metadata `authorization: Bearer <token>` (UNAUTHENTICATED).")
    grace_s: float = option(10.0, "Seconds in-flight calls get to finish after SIGTERM.")
    max_connection_age_s: float = option(
        0.0,
        "Close each client connection this long after it opened (calls in flight keep going), so coordinators "
        "dialling a dns:/// name re-resolve it and find replicas added since; 0: never.",
    )
    event_loop: str = event_loop_option()
    log_format: str = log_format_option()
    log_level: str = log_level_option()

    def __post_init__(self):
        check_backend_token(self.backend_token)
        check_weights(self.weights, self.packed_gemm_rows)
        check_static(self.numerics, self.pass_rows, self.static_slots, self.static_context)
        if not 0 <= self.packed_gemm_rows <= gemm.MAX_ROWS:
            raise ValueError(f"--packed-gemm-rows must be in [0, {gemm.MAX_ROWS}], got {self.packed_gemm_rows}")
        if not self.batch_window_ms >= 0:
            raise ValueError(f"--batch-window-ms must be >= 0, got {self.batch_window_ms}")
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"--max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
        if self.compute_threads < 0:
            raise ValueError(f"--compute-threads must be >= 0, got {self.compute_threads}")
        if self.max_prefill_tokens_per_pass < 0:
            raise ValueError(f"--max-prefill-tokens-per-pass must be >= 0, got {self.max_prefill_tokens_per_pass}")
