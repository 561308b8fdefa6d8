"""Target service configuration: flags, or SPECDEC_TARGET_* environment variables."""

from __future__ import annotations

import dataclasses

from specdec.model.cpu import gemm
from specdec.serving.config import (backend_token_option, check_backend_token, check_static, compute_threads_option,
                                    check_weights, event_loop_option, log_format_option, log_level_option, numerics_option,
                                    option, static_options, weights_option)
from specdec.model.loading import DEFAULT_TARGET

ENV_PREFIX = "SPECDEC_TARGET_"


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Hosts the large model and verifies proposals."""

    host: str = option("127.0.0.1", "Address to listen on (0.0.0.0 in a container).")
    port: int = option(50052, "Port to listen on; 0 picks a free one.")
    metrics_port: int = option(8002, "Port of the Prometheus /metrics endpoint; 0 picks a free one, -1 disables it.")
    model: str = option(DEFAULT_TARGET, "Target model: alias, hub id, local folder or .gguf file.")
    device: str = option("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N.")
    dtype: str = option("auto", "auto (fp32 on CPU, bf16/fp16 on GPU), float32, float16 or bfloat16.")
    packed_gemm_rows: int = option(
        gemm.DEFAULT_ROWS,
        "CPU float32 only: forwards over --packed-gemm-min-rows..N positions use specdec's GEMM kernel, "
        "compiled on first use (verifying up to 16 positions costs about what one does; batches and prefills "
        "cost less than with the stock kernel; its weight panels add about the model's size in memory); 0 "
        "turns it off.",
    )
    packed_gemm_min_rows: int = option(
        gemm.DEFAULT_MIN_ROWS,
        "Fewest positions that take the small-M kernel; shorter forwards keep the stock kernel (1: decode "
        "steps take it too).",
    )
    weights: str = weights_option()
    compute_threads: int = compute_threads_option()
    numerics: str = numerics_option()
    pass_rows: int = static_options()[0]
    static_slots: int = static_options()[1]
    static_context: int = static_options()[2]
    max_sequences: int = option(256, "Sequences held at once; past it the least recently used is evicted (and re-filled on demand).")
    idle_timeout_s: float = option(600.0, "Free a sequence untouched this long (a coordinator that vanished); 0 disables.")
    batch_window_ms: float = option(
        2.0,
        "How long a Verify waits for the other sequences' calls to share its forward pass (continuous "
        "batching); 0: no wait.",
    )
    draft: str = option(
        "",
        "Address of a draft service this target asks for proposals itself (one Drafts stream): a coordinator "
        "then starts its model-draft requests as drafted runs, and a step crosses the wire twice (target -> "
        "draft -> target) instead of four times through the coordinator. Empty: none.",
    )
    max_batch_size: int = option(16, "Most sequences verified in one forward pass; 1 turns batching off.")
    max_batch_tokens: int = option(
        256,
        "Most padded positions (rows x longest row's new tokens) in one pass: long prefills run alone. Where "
        "the compact stack runs the pass (nothing padded), the rows' positions, a long prompt counting one chunk.",
    )
    max_prefill_tokens_per_pass: int = option(
        256,
        "Chunked prefill: a prompt longer than this is fed at most this many tokens a pass, with the other "
        "sequences' steps run between two chunks, so one long prompt delays them by one chunk's pass, not by "
        "its whole prefill. Chunks are cut shorter where the measured costs say one would take longer than three "
        "quarters of the others' step per prompt waiting per decoding sequence (CPUs), and 8 times longer for "
        "the only sequence the target holds; 0: a prompt is fed in one pass.",
    )
    tls_cert: str = option("", "PEM certificate this server presents; with --tls-key turns TLS on.")
    tls_key: str = option("", "PEM private key of --tls-cert.")
    tls_ca: str = option("", "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).")
    backend_token: str = backend_token_option(
        "the target refuses every call but health checks that lacks metadata `authorization: Bearer <token>` "
        "(UNAUTHENTICATED), and sends it to its --draft.")
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
        if self.packed_gemm_rows and not 1 <= self.packed_gemm_min_rows <= self.packed_gemm_rows:
            raise ValueError(f"--packed-gemm-min-rows must be in [1, --packed-gemm-rows={self.packed_gemm_rows}], "
                             f"got {self.packed_gemm_min_rows}")
        if not self.batch_window_ms >= 0:
            raise ValueError(f"--batch-window-ms must be >= 0, got {self.batch_window_ms}")
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.compute_threads < 0:
            raise ValueError(f"--compute-threads must be >= 0, got {self.compute_threads}")
        if self.max_prefill_tokens_per_pass < 0:
            raise ValueError(f"--max-prefill-tokens-per-pass must be >= 0, got {self.max_prefill_tokens_per_pass}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"--max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
