"""The public gRPC API: a request in (validated by coordinator/validate.py), the speculative loop, text streamed out.
The process that serves it (backends, TLS, the HTTP API beside it) is coordinator/serve.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from specdec.maths.costs import MODEL_DRAFT_PRIOR, NGRAM_DRAFT_PRIOR, CostModel, knee
from coordinator.clients import REQUEST_DEADLINE, DraftClient, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import GenerationSpec, Stats
from coordinator.policy.admission import Admission, client_key, grpc_peer_host
from coordinator.readiness import BackendHealth
from coordinator.text import TextStream
from coordinator.validate import generation_spec
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.serving import metrics
from specdec.errors import DeadlineExceeded, InvalidArgument, Overloaded, SpecdecError, Unavailable
from specdec.serving.rpc import error_status, rpc_method
from specdec.serving.logs import bind_request
from specdec.serving.wire import logprobs_to_proto
from specdec.maths.sampling import TokenLogprob

log = structlog.get_logger(__name__)

# vLLM's default long-prompt threshold: this share of the model's context.
LONG_PREFILL_SHARE = 0.04

FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP_STRING,
}


class Chunk(NamedTuple):
    """What one step gives the client: its tokens (after any stop string), the text they settle, and
    on the last step why generation ended. `stats` is the request's, updated in place."""

    spec: GenerationSpec
    tokens: list[int]
    text: str
    finish: str | None
    stats: Stats
    logprobs: tuple[TokenLogprob, ...] = ()  # with spec.logprobs: one per token


def stats_proto(stats: Stats) -> pb.GenerationStats:
    return pb.GenerationStats(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        steps=stats.steps,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        wire_seconds=stats.wire_seconds,
        total_seconds=stats.total_seconds,
        time_to_first_token_seconds=stats.time_to_first_token_seconds,
        accepted_per_position=stats.accepted_per_position,
        wire_bytes=stats.wire_bytes,
        draft_steps=stats.draft_steps,
        runahead_steps=stats.runahead_steps,
        runahead_hits=stats.runahead_hits,
        runahead_tokens=stats.runahead_tokens,
        runahead_used_tokens=stats.runahead_used_tokens,
        first_step_tokens=stats.first_step_tokens,
        load_capped_steps=stats.load_capped_steps,
        prediction_tokens=stats.prediction_tokens,
        accepted_prediction_tokens=stats.accepted_prediction_tokens,
    )


def record_request(m: metrics.CoordinatorMetrics, stats: Stats) -> None:
    """Adds a request's statistics to the counters, so /metrics agrees with the responses."""
    m.prompt_tokens.inc(stats.prompt_tokens)
    m.generation_tokens.inc(stats.completion_tokens)
    m.steps.inc(stats.steps)
    m.num_drafts.inc(stats.draft_steps)
    m.load_capped_steps.inc(stats.load_capped_steps)
    m.num_draft_tokens.inc(stats.draft_tokens)
    m.num_accepted_tokens.inc(stats.accepted_tokens)
    for position, count in enumerate(stats.accepted_per_position):
        if count:
            m.accepted_per_pos.labels(str(position)).inc(count)
    if stats.completion_tokens:
        m.ttft.observe(stats.time_to_first_token_seconds)
        m.e2e.observe(stats.total_seconds)
        # vLLM's split of a request's time: the queue is observed by Admission, on admission.
        m.prefill_time.observe(stats.time_to_first_token_seconds)
        m.decode_time.observe(stats.total_seconds - stats.time_to_first_token_seconds)


def _observe_itl(m: metrics.CoordinatorMetrics, stats: Stats, first: bool, keep: int, since_last: float) -> None:
    """Inter-token latency of a step's `keep` tokens, `since_last` seconds after the step before.
    The first step's own tokens have a TTFT, not an ITL; the tokens its exchange decoded ahead after
    them (a request answered whole) came over the time after the first token."""
    if not first:
        if keep:
            metrics.observe_many(m.itl, since_last / keep, keep)
        return
    later = keep - stats.first_step_tokens
    if later > 0:
        metrics.observe_many(m.itl, (stats.total_seconds - stats.time_to_first_token_seconds) / later, later)


def client_of(context, id_header: str = "") -> tuple[str, float | None]:
    """(who is calling, as coordinator/policy/admission.py's `client_key` names clients; their
    deadline as a time.monotonic() value or None). `id_header`: --client-id-header."""
    client_id = ""
    if id_header:
        client_id = str(dict(context.invocation_metadata() or ()).get(id_header.lower(), ""))
    who = client_key(grpc_peer_host(context.peer() or ""), client_id)
    remaining = context.time_remaining()
    return who, (time.monotonic() + remaining if remaining is not None else None)


def make_loop(config: CoordinatorConfig, target, draft, draft_info: pb.ModelInfo | None,
              draft_cap: Callable[[], int] | None = None, target_info: pb.ModelInfo | None = None) -> SpeculativeLoop:
    """The loop a coordinator with `config` runs over these backends: the one place its defaults
    are applied, so that tests of the guarantee run exactly what users get."""
    ngram = draft_info is not None and draft_info.drafter == "ngram"  # its confidences are calibrated (draft_service/drafters/ngram.py)
    prior = NGRAM_DRAFT_PRIOR if ngram else MODEL_DRAFT_PRIOR
    cost_model = CostModel(prior)
    cost_model.draft_cap = draft_cap  # draft less as more requests share the target's batch
    features = bool(draft_info is not None and draft_info.needs_features)  # a feature draft (specdec/model/feature_draft.py)
    return SpeculativeLoop(target, draft, cost_model, prior, config.overlap, features=features,
                           calibrated=ngram, decode_ahead=config.decode_ahead, lookup=ngram and config.lookup_ahead,
                           decoder=getattr(target, "decoder", None) if config.decode_runs else None,
                           # only where the target's draft service is this coordinator's own
                           target_drafts=bool(target_info is not None and target_info.draft and target_info.draft == config.draft),
                           stream_interval=config.stream_interval)


class CoordinatorServicer(pb_grpc.CoordinatorServiceServicer):
    """Registered before the server starts; answers UNAVAILABLE until `attach` connects the backends."""

    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.tokenizer = None
        self.loop: SpeculativeLoop | None = None
        self.target_info = pb.ModelInfo()
        self.active: dict[str, int] = {}  # running requests per client
        self.backends: BackendHealth | None = None  # whether the target (and draft) answer, once serving
        metrics.set_model_name(config.model_names()[0])  # the model id /v1/models reports first labels the request metrics
        self.admission = Admission(config.max_concurrent_requests, config.max_queue, config.verify_token_budget,
                                   on_queue=metrics.coordinator().waiting.set,  # specdec:num_requests_waiting
                                   on_admit=metrics.coordinator().queue_time.observe,  # specdec:request_queue_time_seconds
                                   max_partial_prefills=config.max_num_partial_prefills,
                                   max_long_partial_prefills=config.max_long_partial_prefills)

    def attach(self, tokenizer, target: TargetClient, target_info: pb.ModelInfo, draft: DraftClient | None,
               draft_info: pb.ModelInfo | None) -> None:
        self.tokenizer = tokenizer
        self.target_info = target_info
        self.admission.prefill_chunk_tokens = target_info.prefill_chunk_tokens
        self.admission.long_prefill_tokens = (self.config.long_prefill_token_threshold
                                              or int(LONG_PREFILL_SHARE * target_info.max_context))
        self.loop = make_loop(self.config, target, draft, draft_info, self.admission.draft_cap, target_info)
        cost_model = self.loop.cost_model
        if self.config.verify_token_budget == -2:  # the target's knee, timed on its device at its start
            self.admission.measured_budget = lambda: target_info.verify_knee or 8
        else:  # -1: the knee of the costs this coordinator measures
            self.admission.measured_budget = lambda: knee(cost_model.costs())

    def _spec(self, request) -> tuple[GenerationSpec, list[str]]:
        """The request as a validated spec and its stop strings: the checks are coordinator/validate.py's,
        the ones the HTTP API's requests pass too. UNAVAILABLE until `attach`."""
        if self.loop is None:
            raise Unavailable("the coordinator is still connecting to the draft and target services")
        return generation_spec(request, self.config, self.tokenizer, self.target_info)

    def prompt_ids(self, request) -> list[int]:
        """The prompt of `request` in target token ids, checked as a generation would check it."""
        spec, _ = self._spec(request)
        return spec.prompt_ids

    @contextlib.contextmanager
    def _admit(self, client: str):
        """Caps one client's concurrent requests, so no single client can take every slot."""
        limit = self.config.streams_per_client()
        if limit and self.active.get(client, 0) >= limit:
            raise Overloaded(f"this client already has {limit} requests running or queued (max_streams_per_client); "
                             "retry after one finishes")
        self.active[client] = self.active.get(client, 0) + 1
        try:
            yield
        finally:
            self.active[client] -= 1
            if not self.active[client]:
                del self.active[client]

    async def _generate(self, request, client: str = "http", deadline: float | None = None, whole: bool = False):
        """Yields a Chunk per step.

        Shared by the gRPC methods and the HTTP API; records the request's metrics.
        `deadline` (time.monotonic()) bounds every internal call made for the request. `whole`: the
        caller answers only once the request ends (GenerationSpec.answered_whole, unless stop
        strings must be looked for as the tokens come).
        """
        m = metrics.coordinator()
        try:
            # Off the event loop: tokenizing a long prompt takes a while, and the loop serves every
            # other request and /health meanwhile (the fast tokenizer's encode is thread-safe).
            spec, stop = await asyncio.to_thread(self._spec, request)
            if whole and not stop:
                spec = dataclasses.replace(spec, answered_whole=True)
            with self._admit(client):  # the per-client cap counts queued requests too
                async with self.admission.slot(len(spec.prompt_ids)) as admitted:
                    REQUEST_DEADLINE.set(deadline)
                    async for item in self._run_spec(spec, stop, m, admitted.prefilled):
                        yield item
        except SpecdecError as exc:
            m.failures.labels(exc.code.name).inc()
            raise

    async def _run_spec(self, spec: GenerationSpec, stop: list[str], m, prefilled: Callable[[], None] = lambda: None):
        bind_request(spec.request_id)
        log.info("request started", prompt_tokens=len(spec.prompt_ids), max_new_tokens=spec.max_new_tokens,
                 temperature=spec.sampling.temperature, draft_length=spec.draft_length, adaptive=spec.adaptive)
        stats = Stats()
        text = TextStream(self.tokenizer, stop, spec.min_tokens)
        m.running.inc()
        last_emit = time.perf_counter()
        try:
            async with contextlib.aclosing(self.loop.run(spec, stats)) as steps:
                async for step in steps:
                    first = stats.completion_tokens == len(step.tokens)
                    if first:
                        prefilled()
                    piece, keep = text.add(step.tokens, final=step.finish_reason is not None)
                    finish = "stop" if text.stopped_at is not None else step.finish_reason
                    if keep < len(step.tokens):
                        stats.completion_tokens -= len(step.tokens) - keep
                        stats.first_step_tokens = min(stats.first_step_tokens, stats.completion_tokens)
                    now = time.perf_counter()
                    _observe_itl(m, stats, first, keep, now - last_emit)
                    last_emit = now
                    if finish:
                        # Counted before the last chunk goes out: a streaming client that has what it
                        # wants closes this generator at that yield, and nothing after it runs.
                        m.requests.labels(finish).inc()
                        log.info("request finished", finish_reason=finish, completion_tokens=stats.completion_tokens,
                                 steps=stats.steps, acceptance_rate=round(stats.acceptance_rate, 3),
                                 seconds=round(stats.total_seconds, 3))
                    yield Chunk(spec, step.tokens[:keep], piece, finish, stats, step.logprobs[:keep])
                    if finish:
                        break
        except grpc.aio.AioRpcError as exc:
            # A backend failed past its retries: the client learns which, with the backend's code.
            code = exc.code()
            log.warning("request failed: a backend call failed", code=code.name, details=exc.details())
            bound = REQUEST_DEADLINE.get()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and bound is not None and time.monotonic() >= bound:
                raise DeadlineExceeded("the request's deadline passed") from exc
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument("request", f"rejected by a backend: {exc.details()}") from exc
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Overloaded(f"a backend is at capacity: {exc.details()}") from exc
            raise Unavailable(f"backend call failed with {code.name}: {exc.details()}") from exc
        finally:
            m.running.dec()
            record_request(m, stats)

    @rpc_method
    async def Generate(self, request: pb.GenerateRequest, context):
        token_ids: list[int] = []
        pieces: list[str] = []
        logprobs: list = []
        try:
            async for chunk in self._generate(request, *client_of(context, self.config.client_id_header), whole=True):
                token_ids.extend(chunk.tokens)
                pieces.append(chunk.text)
                logprobs.extend(chunk.logprobs)
        except Overloaded as exc:
            await abort_overloaded(context, exc)
        return pb.GenerateResponse(request_id=chunk.spec.request_id, text="".join(pieces), token_ids=token_ids,
                                   finish_reason=FINISH_REASONS[chunk.finish], stats=stats_proto(chunk.stats),
                                   logprobs=logprobs_to_proto(logprobs))

    @rpc_method
    async def GenerateStream(self, request: pb.GenerateStreamRequest, context):
        """Writes each message with context.write under --stream-stall-timeout-s instead of yielding
        it: a client that stops reading fills gRPC's flow-control window and a yield then waits,
        for as long as the client's deadline, holding a running slot and both services' sequences
        while the target idles. Two such streams under --max-concurrent-requests 2 made another
        client's request fail DEADLINE_EXCEEDED."""
        send = StreamWriter(context, self.config.stream_stall_timeout_s)
        try:
            async with contextlib.aclosing(self._generate(request, *client_of(context, self.config.client_id_header))) as chunks:
                async for chunk in chunks:
                    request_id = chunk.spec.request_id
                    if chunk.tokens or chunk.text:
                        await send(pb.GenerateStreamResponse(request_id=request_id, token_ids=chunk.tokens, text=chunk.text,
                                                             logprobs=logprobs_to_proto(chunk.logprobs)))
                    if chunk.finish:
                        await send(pb.GenerateStreamResponse(request_id=request_id, finish_reason=FINISH_REASONS[chunk.finish],
                                                             stats=stats_proto(chunk.stats)))
        except Overloaded as exc:
            await abort_overloaded(context, exc)
        except ClientStalled:
            metrics.coordinator().failures.labels(ClientStalled.code.name).inc()
            raise


class ClientStalled(SpecdecError):
    """A streaming client stopped reading: its next message waited past --stream-stall-timeout-s."""

    code = grpc.StatusCode.CANCELLED


class StreamWriter:
    """Writes a server stream's messages, each within `timeout_s` (0: no bound)."""

    def __init__(self, context, timeout_s: float):
        self.context, self.timeout_s = context, timeout_s

    async def __call__(self, message) -> None:
        if not self.timeout_s:
            await self.context.write(message)
            return
        try:
            await asyncio.wait_for(self.context.write(message), self.timeout_s)
        except TimeoutError:
            log.warning("ending a stream whose client stopped reading", stall_timeout_s=self.timeout_s)
            raise ClientStalled(f"the client stopped reading: a message waited {self.timeout_s:g}s to be written "
                                "(--stream-stall-timeout-s)") from None


async def abort_overloaded(context, exc: Overloaded) -> None:
    """RESOURCE_EXHAUSTED with a retry hint twice over: a google.rpc.RetryInfo detail (what gRPC
    client libraries read) and `retry-after-ms` trailing metadata (what a person with a plain stub
    can read). The per-client cap's hint is a second: one of that client's own requests must end."""
    retry_s = getattr(exc, "retry_after_s", 1.0)
    status = error_status(exc)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=int(retry_s), nanos=int(retry_s % 1 * 1e9))))
    status.details.append(detail)
    rich = rpc_status.to_status(status)
    retry = ("retry-after-ms", str(round(retry_s * 1000)))
    await context.abort(rich.code, rich.details, trailing_metadata=(*rich.trailing_metadata, retry))
