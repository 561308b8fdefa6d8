"""Prometheus metrics of every service, named in vLLM's style (`specdec:...`).

Metric objects are process-wide singletons (prometheus_client refuses to register a name twice),
created on first use so that importing this module registers nothing. The coordinator serves them
at /metrics on its HTTP port; the draft and target on `--metrics-port`.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

# The capacity a service's store enforces is a count of sequences (--max-sequences), so that is what
# "usage" measures; a fraction from 0 to 1, as vLLM's kv_cache_usage_perc.
KV_USAGE_HELP = ("Fraction (0-1) of the {service}'s sequence slots in use: sequences held over --max-sequences. "
                 "At 1 each new sequence evicts the least recently used one, which its coordinator must then "
                 "re-fill (specdec:sequence_refills): raise --max-sequences if memory allows, or add replicas.")


class ModelLabelled:
    """A metric whose first label is `model_name`, filled in at each use with the model the
    coordinator serves, so the code recording it reads as if the label were not there:
    `m.running.inc()`, `m.requests.labels("eos").inc()`. prometheus_client has no constant labels."""

    def __init__(self, metric, extra_labels: int):
        self.metric, self.extra_labels = metric, extra_labels

    def labels(self, *values: str):
        return self.metric.labels(_model_name, *values)

    def __getattr__(self, method: str):  # inc, dec, set, observe of the model's child
        return getattr(self.metric.labels(_model_name), method)


_model_name = ""


def observe_many(histogram, value: float, count: int) -> None:
    """Records `count` observations of `value`, as `count` calls of observe would, in one update: a
    step's burst of tokens shares one gap (the inter-token latency), and a unary request's burst of
    a hundred tokens or more cost as many calls, each taking the child's lock, on the event loop.
    Falls back to the calls where prometheus_client's histogram is not laid out as in 0.20 and later."""
    child = histogram.metric.labels(_model_name) if isinstance(histogram, ModelLabelled) else histogram
    total, buckets, bounds = (getattr(child, name, None) for name in ("_sum", "_buckets", "_upper_bounds"))
    if total is None or buckets is None or bounds is None or len(buckets) != len(bounds):
        for _ in range(count):
            child.observe(value)
        return
    total.inc(value * count)
    for bucket, bound in zip(buckets, bounds):
        if value <= bound:
            bucket.inc(count)
            return


def set_model_name(name: str) -> None:
    """The value of the coordinator's `model_name` label (the model id its HTTP API reports).
    Process-wide, as the metrics are: the last coordinator started in a process names them."""
    global _model_name
    _model_name = name
    for metric in vars(coordinator()).values():
        if not metric.extra_labels:
            metric.labels()  # exported from the start (a 0), as an unlabelled metric would be


def _labelled(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kwargs) -> ModelLabelled:
    return ModelLabelled(kind(name, doc, ["model_name", *labels], **kwargs), len(labels))


class CoordinatorMetrics:
    """Request-level metrics, each labelled with `model_name` as vLLM labels its own."""

    def __init__(self):
        self.requests = _labelled(Counter, "specdec:request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.failures = _labelled(Counter, "specdec:request_failure", "Failed requests, by gRPC status code.", ("code",))
        self.running = _labelled(Gauge, "specdec:num_requests_running", "Requests being generated now.")
        self.waiting = _labelled(Gauge, "specdec:num_requests_waiting", "Requests accepted but not yet started (queue depth).")
        self.ttft = _labelled(Histogram, "specdec:time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS)
        self.itl = _labelled(Histogram, "specdec:inter_token_latency_seconds",
                             "Time between tokens as streamed (a step's gap shared by its tokens).", buckets=LATENCY_BUCKETS)
        self.e2e = _labelled(Histogram, "specdec:e2e_request_latency_seconds", "End-to-end request latency.", buckets=LATENCY_BUCKETS)
        self.queue_time = _labelled(Histogram, "specdec:request_queue_time_seconds",
                                    "Time a request waited in the admission queue for a running slot (0 when one was free).",
                                    buckets=LATENCY_BUCKETS)
        self.prefill_time = _labelled(Histogram, "specdec:request_prefill_time_seconds",
                                      "From a request's start (after the queue) to its first token: the prompt's prefill.",
                                      buckets=LATENCY_BUCKETS)
        self.decode_time = _labelled(Histogram, "specdec:request_decode_time_seconds",
                                     "From a request's first token to its last: the decode, speculative steps included.",
                                     buckets=LATENCY_BUCKETS)
        self.prompt_tokens = _labelled(Counter, "specdec:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = _labelled(Counter, "specdec:generation_tokens", "Tokens generated.")
        self.num_drafts = _labelled(Counter, "specdec:spec_decode_num_drafts", "Speculative steps that verified at least one draft token.")
        self.load_capped_steps = _labelled(Counter, "specdec:spec_decode_load_capped_steps",
                                           "Steps that drafted nothing because the running requests used up --verify-token-budget.")
        self.num_draft_tokens = _labelled(Counter, "specdec:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.num_accepted_tokens = _labelled(Counter, "specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = _labelled(Counter, "specdec:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted draft tokens by position in the draft.", ("position",))
        self.refills = _labelled(Counter, "specdec:sequence_refills", "Sequences re-sent whole to a service that had lost them "
                                 "(a restart, an eviction, a fleet replica gone).", ("service",))
        self.steps = _labelled(Counter, "specdec:spec_decode_num_steps", "Target passes (Verify calls).")


class TargetMetrics:
    def __init__(self):
        self.verify_seconds = Histogram("specdec:target_verify_seconds", "Target compute per Verify call.", buckets=LATENCY_BUCKETS)
        self.batch_size = Histogram("specdec:target_batch_size", "Sequences per target forward pass.", buckets=(1, 2, 4, 8, 16, 32, 64))
        self.sequences = Gauge("specdec:target_num_sequences", "Sequences held in the target's KV caches.")
        self.kv_usage = Gauge("specdec:target_kv_cache_usage_perc", KV_USAGE_HELP.format(service="target"))
        self.sequences_started = Counter("specdec:target_sequences_started", "Sequences this target prefilled (re-fills included).")
        self.draft_tokens = Counter("specdec:target_spec_decode_num_draft_tokens", "Draft tokens the target verified.")
        self.accepted_tokens = Counter("specdec:target_spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")


class DraftMetrics:
    def __init__(self):
        self.propose_seconds = Histogram("specdec:draft_propose_seconds", "Draft compute per Propose call.", buckets=LATENCY_BUCKETS)
        self.proposed_tokens = Counter("specdec:draft_num_proposed_tokens", "Tokens the draft proposed.")
        self.sequences = Gauge("specdec:draft_num_sequences", "Sequences held in the draft's caches.")
        self.kv_usage = Gauge("specdec:draft_kv_cache_usage_perc", KV_USAGE_HELP.format(service="draft"))
        self.sequences_started = Counter("specdec:draft_sequences_started", "Sequences this draft prefilled (re-fills included).")


def follow_store(store, sequences: Gauge, usage: Gauge) -> None:
    """Keeps a service's gauges equal to what its SequenceStore holds, on every change of it
    (releases and expiries included, not only the calls that create sequences)."""
    def held(count: int) -> None:
        sequences.set(count)
        usage.set(count / store.max_sequences if store.max_sequences else 0.0)

    store.on_change = held
    held(len(store))


@functools.cache
def coordinator() -> CoordinatorMetrics:
    return CoordinatorMetrics()


@functools.cache
def target() -> TargetMetrics:
    return TargetMetrics()


@functools.cache
def draft() -> DraftMetrics:
    return DraftMetrics()


def serve_http(port: int, host: str = "0.0.0.0") -> int:
    """Starts /metrics on its own thread; returns the bound port (0 picks one). -1 disables it."""
    if port < 0:
        return -1
    server, _thread = start_http_server(port, addr=host)
    return server.server_port
