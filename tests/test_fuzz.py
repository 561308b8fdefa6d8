"""Property-based fuzzing (hypothesis) of every RPC of the three services, on tiny models.

Requests carry malformed and extreme values: negative and huge integers, out-of-vocabulary ids,
NaN / infinite / negative / subnormal floats, empty and huge lists and strings, mismatched lengths
of draft tokens and their distributions, known_len past what a service holds. Whatever arrives:
  * the status is never INTERNAL or UNKNOWN (those mean a bug);
  * every INVALID_ARGUMENT names a real field of the request, in its message ("field: ...") and in
    a google.rpc.BadRequest field violation;
  * a successful answer is sane (token ids in the vocabulary, counts within their bounds);
  * the services stay healthy, keep serving correct greedy output, and hold no sequence once the
    ids the fuzzer used are released.
A summary (calls per RPC, status counts) is printed; run with -s to see it.
"""

from __future__ import annotations

import collections
import math
import re
import uuid

import grpc
import torch
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests import tiny
from tests.services import healthy
from tests.stack import Stack

MAX_NEW = 6  # the fuzzed coordinator's limit: keeps every successful generation short
CALL_TIMEOUT = 30.0
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))

STATUS = collections.defaultdict(collections.Counter)  # rpc -> status name -> calls
EXAMPLES: dict[tuple[str, str], str] = {}  # (rpc, status) -> one message
USED_IDS: dict[str, set[str]] = {"draft": set(), "ngram": set(), "target": set()}


# --- strategies: well-formed requests with a few fields replaced by extreme values ----------------
#
# A request with every field extreme is rejected by the first check it meets; mutating only some
# fields of a valid request lets the fuzzer reach the code behind the validation too.

INT32 = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([-(2**31), -1, 0, 1, 255, 256, tiny.VOCAB - 1, tiny.VOCAB, 511, 512, 513, 2**31 - 1]),
    st.integers(-(2**31), 2**31 - 1),
)
VALID_TOKEN = st.integers(0, tiny.VOCAB - 1)
TOKEN = st.one_of(VALID_TOKEN, INT32)
VALID_TOKENS = st.lists(VALID_TOKEN, min_size=1, max_size=30)
TOKENS = st.one_of(
    st.lists(TOKEN, max_size=12),
    st.just([]),
    st.lists(st.integers(0, 255), min_size=500, max_size=800),  # past the tiny models' context of 512
)
FLOAT32 = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 0.5, 2.0, -1.0, 1e-45, 1e-38, 1e-30, 3.4e38, math.nan, math.inf, -math.inf]),
    st.floats(width=32),
)
UINT64 = st.one_of(st.integers(0, 10), st.integers(0, 2**64 - 1))
HUGE_STRING = st.builds(lambda c, n: c * n, st.characters(), st.integers(1000, 100_000))
STRING = st.one_of(st.text(max_size=30), st.just(""), HUGE_STRING)
FRESH_ID = st.builds(lambda: uuid.uuid4().hex)
SEQUENCE_ID = st.one_of(st.sampled_from(["", "a", "é\x00\U0001f600"]), st.text(max_size=300), HUGE_STRING)


def mutated(draw, valid: dict, extreme: dict) -> dict:
    """`valid` field values with a drawn few (often none) replaced by draws from `extreme`."""
    chosen = draw(st.sets(st.sampled_from(sorted(extreme)), max_size=3))
    return {name: draw(extreme[name] if name in chosen else valid[name]) for name in valid}


def fields(**kwargs) -> dict:
    """Keyword arguments for a message constructor, leaving unset what the strategy made None."""
    return {k: v for k, v in kwargs.items() if v is not None}


@st.composite
def sampling_params(draw):
    valid = {
        "temperature": st.sampled_from([None, 0.0]) | st.floats(0.0625, 2.0, width=32),
        "top_k": st.none() | st.integers(0, 300),
        "top_p": st.none() | st.floats(0.0625, 1.0, width=32),
        "seed": st.none() | UINT64,
    }
    extreme = {"temperature": FLOAT32, "top_k": INT32, "top_p": FLOAT32, "seed": UINT64}
    return pb.SamplingParams(**fields(**mutated(draw, valid, extreme)))


@st.composite
def chat_messages(draw):
    roles = st.sampled_from(["user", "system", "assistant"])
    if draw(st.booleans()):
        roles = roles | st.sampled_from(["", "tool"]) | STRING
    messages = draw(st.lists(st.builds(pb.ChatMessage, role=roles, content=st.text(max_size=20) | STRING), max_size=4))
    return {"chat": pb.ChatMessages(messages=messages)}


PROMPT = st.one_of(
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, VALID_TOKENS),
    st.builds(lambda t: {"text": t}, st.text(min_size=1, max_size=30)),
    chat_messages(),
)
BAD_PROMPT = st.one_of(
    st.just({}),
    st.builds(lambda t: {"text": t}, STRING),
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, TOKENS),
)


def generate_request(cls):
    @st.composite
    def build(draw):
        valid = {
            "prompt": PROMPT,
            "max_new_tokens": st.none() | st.integers(1, MAX_NEW),
            "sampling": st.none() | sampling_params(),
            "speculation": st.none() | st.builds(pb.SpeculationParams, draft_length=st.integers(0, 32), adaptive=st.booleans()),
            "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
            "request_id": st.none() | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
        }
        extreme = {
            "prompt": BAD_PROMPT,
            "max_new_tokens": INT32,
            "speculation": st.builds(
                lambda **kw: pb.SpeculationParams(**fields(**kw)), draft_length=st.none() | INT32, adaptive=st.none() | st.booleans(),
                tree_budget=st.none() | st.integers(0, 12) | INT32, tree_top_k=st.none() | st.integers(1, 4) | INT32,
                tree_shape=st.none() | st.lists(st.integers(1, 3), max_size=3) | st.lists(INT32, max_size=40),
            ),
            "stop": st.lists(STRING, max_size=3),
            "request_id": STRING,
        }
        values = mutated(draw, valid, extreme)
        return cls(**values.pop("prompt"), **fields(**values))

    return build()


@st.composite
def distributions(draw, tokens: list[int]) -> list[pb.SparseDistribution]:
    """One well-formed sparse p per draft token (its support includes the token), or a mangled list."""
    if draw(st.booleans()):
        return []  # no distributions: one-hot p (the n-gram drafter), or greedy
    dists = []
    for token in tokens:
        support = sorted({token % tiny.VOCAB, *draw(st.lists(VALID_TOKEN, max_size=4))})
        weights = draw(st.lists(st.floats(0.01, 1.0), min_size=len(support), max_size=len(support)))
        dists.append(pb.SparseDistribution(token_ids=support, probs=[w / sum(weights) for w in weights]))
    if draw(st.booleans()):
        return dists
    bad = st.builds(
        lambda ids, probs: pb.SparseDistribution(token_ids=ids, probs=probs),
        st.lists(TOKEN, max_size=5),
        st.lists(st.floats(0, 1, width=32) | FLOAT32, max_size=5),
    )
    mangle = draw(st.sampled_from(["replace", "drop", "add"]))
    if mangle == "replace" and dists:
        dists[draw(st.integers(0, len(dists) - 1))] = draw(bad)
    elif mangle == "drop" and dists:
        dists.pop()
    else:
        dists.append(draw(bad))
    return dists


@st.composite
def verify_call(draw):
    """(prefix to create the sequence with first, or None; the fuzzed VerifyRequest)."""
    prefix = draw(st.none() | VALID_TOKENS)
    held = len(prefix) if prefix else 0
    valid = {
        "sequence_id": FRESH_ID,
        "known_len": st.integers(0, held),
        "append_tokens": VALID_TOKENS,
        "draft_tokens": st.lists(VALID_TOKEN, max_size=8),
        "sampling": sampling_params(),
    }
    extreme = {
        "sequence_id": SEQUENCE_ID,
        "known_len": INT32 | st.just(held + 1),
        "append_tokens": TOKENS,
        "draft_tokens": st.lists(TOKEN, max_size=40),
        "sampling": sampling_params(),
    }
    values = mutated(draw, valid, extreme)
    if values["known_len"] == 0 and not draw(st.booleans()):
        values["append_tokens"] = draw(st.just([]) | TOKENS)  # a new sequence without its tokens
    values["draft_dists"] = draw(distributions(values["draft_tokens"]))
    return prefix, pb.VerifyRequest(**values)


@st.composite
def draft_tree(draw) -> pb.DraftTree:
    """A well-formed tree (parents before children; with sampling, each position's children drawn
    without replacement from its sparse p), or one with its parents, tokens or p mangled."""
    n = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [0] * n
    dists = [pb.SparseDistribution() for _ in range(n + 1)]
    for position in range(n + 1):
        kids = [i for i, parent in enumerate(parents) if parent == position - 1]
        if not kids:
            continue
        support = sorted(set(draw(st.lists(VALID_TOKEN, min_size=len(kids) + 2, max_size=len(kids) + 6))))
        if len(support) < len(kids):
            support = list(range(len(kids) + 2))
        for kid, token in zip(kids, draw(st.permutations(support))):
            tokens[kid] = token
        weights = draw(st.lists(st.floats(0.01, 1.0), min_size=len(support), max_size=len(support)))
        dists[position] = pb.SparseDistribution(token_ids=support, probs=[w / sum(weights) for w in weights])
    tree = pb.DraftTree(parents=parents, tokens=tokens, child_dists=dists if draw(st.booleans()) else [])
    mangle = draw(st.sampled_from(["none", "none", "parents", "tokens", "dists", "sizes"]))
    if mangle == "parents":
        tree = pb.DraftTree(parents=draw(st.lists(INT32, min_size=n, max_size=n)), tokens=tokens, child_dists=tree.child_dists)
    elif mangle == "tokens":
        tree = pb.DraftTree(parents=parents, tokens=draw(st.lists(TOKEN, min_size=n, max_size=n)), child_dists=tree.child_dists)
    elif mangle == "dists":
        bad = st.builds(lambda ids, probs: pb.SparseDistribution(token_ids=ids, probs=probs),
                        st.lists(TOKEN, max_size=5), st.lists(st.floats(0, 1, width=32) | FLOAT32, max_size=5))
        tree = pb.DraftTree(parents=parents, tokens=tokens, child_dists=draw(st.lists(bad, max_size=n + 2)))
    elif mangle == "sizes":
        tree = pb.DraftTree(parents=draw(st.lists(st.integers(-1, 0), max_size=70)), tokens=draw(st.lists(VALID_TOKEN, max_size=70)))
    return tree


@st.composite
def verify_tree_call(draw):
    """(prefix, a VerifyRequest carrying a draft tree, sometimes with draft tokens too)."""
    prefix, request = draw(verify_call())
    request.ClearField("draft_tokens")
    request.ClearField("draft_dists")
    request.draft_tree.CopyFrom(draw(draft_tree()))
    if draw(st.sampled_from([False] * 9 + [True])):  # hypothesis favours the first value: mostly False
        request.draft_tokens.append(1)  # both kinds of proposal: refused
    return prefix, request


@st.composite
def propose_tree_call(draw):
    prefix, base = draw(propose_call())
    valid = {"budget": st.integers(1, 12), "top_k": st.integers(1, 4), "shape": st.just([]) | st.lists(st.integers(1, 3), max_size=4),
             "max_depth": st.integers(1, 6)}
    extreme = {"budget": INT32, "top_k": INT32, "shape": st.lists(INT32, max_size=40), "max_depth": INT32}
    params = pb.TreeParams(**mutated(draw, valid, extreme))
    return prefix, pb.ProposeTreeRequest(sequence_id=base.sequence_id, known_len=base.known_len, append_tokens=base.append_tokens,
                                         tree=params, temperature=base.temperature, seed=base.seed)


@st.composite
def propose_call(draw):
    """(prefix to create the sequence with first, or None; the fuzzed ProposeRequest)."""
    prefix = draw(st.none() | VALID_TOKENS)
    held = len(prefix) if prefix else 0
    valid = {
        "sequence_id": FRESH_ID,
        "known_len": st.integers(0, held),
        "append_tokens": VALID_TOKENS,
        "max_tokens": st.integers(0, 8),
        "min_cumulative_prob": st.floats(0, 1, width=32),
        "temperature": st.just(0.0) | st.floats(0.0625, 2.0, width=32),
        "seed": UINT64,
    }
    extreme = {
        "sequence_id": SEQUENCE_ID,
        "known_len": INT32 | st.just(held + 1),
        "append_tokens": TOKENS,
        "max_tokens": INT32,
        "min_cumulative_prob": FLOAT32,
        "temperature": FLOAT32,
        "seed": UINT64,
    }
    return prefix, pb.ProposeRequest(**mutated(draw, valid, extreme))


# --- the servers and the checks --------------------------------------------------------------------


def field_paths(descriptor, prefix: str = "") -> set[str]:
    """Every field path of a message ("sampling.temperature"), and its oneof names ("prompt")."""
    paths = {prefix + o.name for o in descriptor.oneofs if not o.name.startswith("_")}
    for f in descriptor.fields:
        paths.add(prefix + f.name)
        if f.message_type is not None:
            paths |= field_paths(f.message_type, prefix + f.name + ".")
    return paths


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target_model, draft_model = tiny.tiny_pair(seed=0)
    folder = tmp_path_factory.mktemp("fuzz")
    target_path, draft_path = tiny.save(target_model, folder / "target"), tiny.save(draft_model, folder / "draft")
    stack = Stack()
    target = stack.target(target_path)
    draft = stack.draft(drafter="model", model=draft_path)
    ngram = stack.draft(drafter="ngram")
    coordinator = stack.coordinator(target, draft, tiny.byte_tokenizer(), max_new_tokens=MAX_NEW, default_max_new_tokens=MAX_NEW)
    channels = {
        name: grpc.insecure_channel(address)
        for name, address in (("target", target), ("draft", draft), ("ngram", ngram), ("coordinator", coordinator))
    }
    yield {
        "model": target_model,
        "stack": stack,
        "addresses": {"target": target, "draft": draft, "ngram": ngram, "coordinator": coordinator},
        "target": pb_grpc.TargetServiceStub(channels["target"]),
        "draft": pb_grpc.DraftServiceStub(channels["draft"]),
        "ngram": pb_grpc.DraftServiceStub(channels["ngram"]),
        "coordinator": pb_grpc.CoordinatorServiceStub(channels["coordinator"]),
    }
    for channel in channels.values():
        channel.close()
    stack.stop()


def call(rpc: str, request, fn):
    """Makes one call (draining a stream); checks its status. Returns the response(s) or None."""
    try:
        result = fn(request, timeout=CALL_TIMEOUT)
        if not hasattr(result, "ByteSize"):
            result = list(result)
    except grpc.RpcError as exc:
        code = exc.code()
        STATUS[rpc][code.name] += 1
        note(rpc, exc)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), f"{rpc}: {code.name}: {exc.details()}\n{request!r:.2000}"
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{rpc} hung: {request!r:.2000}"
        # Nothing here runs out of capacity: RESOURCE_EXHAUSTED would be gRPC refusing an oversized reply.
        assert code != grpc.StatusCode.RESOURCE_EXHAUSTED, f"{rpc}: {exc.details()}\n{request!r:.2000}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            check_names_field(rpc, request, exc)
        return None
    STATUS[rpc]["OK"] += 1
    return result


def note(rpc: str, exc: grpc.RpcError) -> None:
    """Keeps one message per (rpc, status) for the summary."""
    EXAMPLES.setdefault((rpc, exc.code().name), (exc.details() or "")[:100])


def setup(fn) -> None:
    """A well-formed call that creates the sequence a fuzzed call then builds on; only an id the
    fuzzer mangled may make it fail (the fuzzed call then shows how)."""
    try:
        fn()
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details().startswith("sequence_id:"), exc.details()


def check_names_field(rpc: str, request, exc: grpc.RpcError) -> None:
    field, sep, _ = (exc.details() or "").partition(":")
    assert sep and re.sub(r"\[\d+\]", "", field) in field_paths(request.DESCRIPTOR), f"{rpc}: rejection names no field: {exc.details()!r}"
    status = rpc_status.from_call(exc)
    assert status is not None and status.details, f"{rpc}: no google.rpc.BadRequest detail: {exc.details()!r}"
    violation = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(violation)
    assert violation.field_violations[0].field == field


def check_generation(tokens: list[int], finish: int, stats: pb.GenerationStats, request) -> None:
    assert tokens or finish == pb.FINISH_REASON_STOP_STRING  # a stop string may cut everything
    assert all(0 <= t < tiny.VOCAB for t in tokens)
    assert len(tokens) <= (request.max_new_tokens if request.HasField("max_new_tokens") else MAX_NEW)
    assert stats.completion_tokens == len(tokens) and stats.accepted_tokens <= stats.draft_tokens


# --- one property per RPC ------------------------------------------------------------------------


@settings(FUZZ, max_examples=150)
@given(request=generate_request(pb.GenerateRequest))
def test_fuzz_generate(env, request):
    response = call("Generate", request, env["coordinator"].Generate)
    if response is not None:
        check_generation(list(response.token_ids), response.finish_reason, response.stats, request)


@settings(FUZZ, max_examples=100)
@given(request=generate_request(pb.GenerateStreamRequest))
def test_fuzz_generate_stream(env, request):
    messages = call("GenerateStream", request, env["coordinator"].GenerateStream)
    if messages is not None:
        final = messages[-1]
        assert final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        check_generation([t for m in messages for t in m.token_ids], final.finish_reason, final.stats, request)


@settings(FUZZ, max_examples=300)
@given(case=verify_call())
def test_fuzz_verify(env, case):
    prefix, request = case
    USED_IDS["target"].add(request.sequence_id)
    if prefix:
        setup(lambda: env["target"].Verify(pb.VerifyRequest(sequence_id=request.sequence_id, append_tokens=prefix), timeout=CALL_TIMEOUT))
    response = call("Verify", request, env["target"].Verify)
    if response is not None:
        assert 0 <= response.accepted <= len(request.draft_tokens)
        assert 0 <= response.next_token < tiny.VOCAB, response
        assert response.cached_len == request.known_len + len(request.append_tokens) + response.accepted
        assert math.isfinite(response.compute_seconds)


def check_tree(tree: pb.DraftTree, path=None) -> None:
    assert len(tree.parents) == len(tree.tokens) and all(-1 <= p < i for i, p in enumerate(tree.parents))
    if path is not None:
        assert all(tree.parents[b] == a for a, b in zip([-1, *path], path)), "not a root-to-node path"


@settings(FUZZ, max_examples=200)
@given(case=verify_tree_call())
def test_fuzz_verify_tree(env, case):
    prefix, request = case
    USED_IDS["target"].add(request.sequence_id)
    if prefix:
        setup(lambda: env["target"].Verify(pb.VerifyRequest(sequence_id=request.sequence_id, append_tokens=prefix), timeout=CALL_TIMEOUT))
    response = call("Verify(tree)", request, env["target"].Verify)
    if response is not None:
        check_tree(request.draft_tree, list(response.accepted_path))
        assert response.accepted == len(response.accepted_path) <= len(request.draft_tree.tokens)
        assert 0 <= response.next_token < tiny.VOCAB
        assert response.cached_len == request.known_len + len(request.append_tokens) + response.accepted


@settings(FUZZ, max_examples=120)
@given(case=propose_tree_call(), service=st.sampled_from(["draft", "ngram"]))
def test_fuzz_propose_tree(env, case, service):
    prefix, request = case
    USED_IDS[service].add(request.sequence_id)
    if prefix:
        setup(lambda: list(env[service].Propose(pb.ProposeRequest(sequence_id=request.sequence_id, append_tokens=prefix), timeout=CALL_TIMEOUT)))
    response = call(f"ProposeTree({service})", request, env[service].ProposeTree)
    if response is not None:
        tree = response.tree
        check_tree(tree)
        assert len(tree.tokens) <= request.tree.budget
        assert not tree.child_dists or len(tree.child_dists) == len(tree.tokens) + 1
        for d in tree.child_dists:
            assert len(d.token_ids) == len(d.probs) and all(math.isfinite(p) and p >= 0 for p in d.probs)
        if service == "draft":
            assert all(0 <= t < tiny.VOCAB for t in tree.tokens)


def propose(env, service: str, case) -> None:
    prefix, request = case
    USED_IDS[service].add(request.sequence_id)
    if prefix:
        setup(
            lambda: list(
                env[service].Propose(pb.ProposeRequest(sequence_id=request.sequence_id, append_tokens=prefix), timeout=CALL_TIMEOUT)
            )
        )
    messages = call(f"Propose({service})", request, env[service].Propose)
    if messages is None:
        return
    assert len(messages) <= request.max_tokens
    for m in messages:
        # A model draft proposes from its vocabulary; the n-gram drafter repeats tokens it was sent.
        assert 0 <= m.token_id < tiny.VOCAB or (service == "ngram" and m.token_id in [*request.append_tokens, *(prefix or ())])
        assert 0 <= m.cumulative_prob <= 1 and len(m.dist.token_ids) == len(m.dist.probs)
        assert all(math.isfinite(p) and p >= 0 for p in m.dist.probs)
        if m.dist.probs:
            assert abs(sum(m.dist.probs) - 1) < 1e-3 and m.token_id in m.dist.token_ids


@settings(FUZZ, max_examples=250)
@given(case=propose_call())
def test_fuzz_propose_model_draft(env, case):
    propose(env, "draft", case)


@settings(FUZZ, max_examples=120)
@given(case=propose_call())
def test_fuzz_propose_ngram_draft(env, case):
    propose(env, "ngram", case)


@settings(FUZZ, max_examples=60)
@given(sequence_id=SEQUENCE_ID | FRESH_ID, service=st.sampled_from(["target", "draft", "ngram"]))
def test_fuzz_release(env, sequence_id, service):
    cls = pb.TargetServiceReleaseRequest if service == "target" else pb.DraftServiceReleaseRequest
    response = call(f"Release({service})", cls(sequence_id=sequence_id), env[service].Release)
    if response is None:  # only an id no sequence can have is refused; releasing an unknown one is fine
        assert STATUS[f"Release({service})"]["INVALID_ARGUMENT"] and not 0 < len(sequence_id) <= 256


# GetInfo requests have no fields, so the fuzzer sends other messages' bytes: unknown fields a
# newer client might add must be ignored, not fail the call.
FOREIGN = st.one_of(verify_call().map(lambda c: c[1]), propose_call().map(lambda c: c[1]), generate_request(pb.GenerateRequest)).map(
    lambda m: m.SerializeToString()
)


@settings(FUZZ, max_examples=40)
@given(payload=FOREIGN, service=st.sampled_from(["TargetService", "DraftService"]))
def test_fuzz_get_info(env, payload, service):
    address = env["addresses"]["target" if service == "TargetService" else "draft"]
    response_cls = pb.TargetServiceGetInfoResponse if service == "TargetService" else pb.DraftServiceGetInfoResponse
    with grpc.insecure_channel(address) as channel:
        method = channel.unary_unary(
            f"/specdec.v1.{service}/GetInfo", request_serializer=None, response_deserializer=response_cls.FromString
        )
        response = call(f"GetInfo({service})", pb.TargetServiceGetInfoRequest(), lambda _, timeout: method(payload, timeout=timeout))
    assert response is not None and response.info.vocab_size == tiny.VOCAB


def test_zz_services_stay_healthy_correct_and_hold_nothing(env):
    """Runs after the properties: every service still SERVING and exact, nothing left allocated."""
    for name, address in env["addresses"].items():
        assert healthy(address), f"{name} is no longer SERVING"
    prompt = tiny.prompts(1, seed=7)[0]
    response = env["coordinator"].Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW), timeout=60)
    assert list(response.token_ids) == tiny.reference_greedy(env["model"], prompt, MAX_NEW)
    for service, ids in USED_IDS.items():
        cls = pb.TargetServiceReleaseRequest if service == "target" else pb.DraftServiceReleaseRequest
        for sequence_id in ids:
            if 0 < len(sequence_id) <= 256:  # the others were refused, never held
                env[service].Release(cls(sequence_id=sequence_id), timeout=10)
    held = {name: len(server.servicer.engine.store) for name, server in zip(("target", "draft", "ngram"), env["stack"].servers)}
    print("\nfuzzing summary (calls per RPC and their status codes):")
    for rpc, counts in sorted(STATUS.items()):
        print(f"  {rpc:<24} {sum(counts.values()):>4} calls  " + ", ".join(f"{code} {n}" for code, n in counts.most_common()))
    print("  one message per RPC and status:")
    for (rpc, code), message in sorted(EXAMPLES.items()):
        print(f"    {rpc} {code}: {message!r}")
    total = collections.Counter()
    for counts in STATUS.values():
        total.update(counts)
    print(
        f"  {'all':<24} {sum(total.values()):>4} calls, INTERNAL {total['INTERNAL']}, UNKNOWN {total['UNKNOWN']}; "
        f"sequences held after releasing the fuzzed ids: {held}"
    )
    assert sum(held.values()) == 0, held


# --- regressions: what the fuzzer found, pinned down -------------------------------------------


def rejected(fn, field: str, code=grpc.StatusCode.INVALID_ARGUMENT) -> None:
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if not hasattr(result, "ByteSize"):
            list(result)
    assert info.value.code() == code, info.value.details()
    assert info.value.details().startswith(field + ":"), info.value.details()


def test_regression_request_id_must_fit_in_metadata(env):
    # Was INTERNAL: the id travels to the backends in gRPC metadata, which takes printable ASCII only.
    for request_id in ("\x1f", "é", "x" * 129):
        rejected(lambda r=request_id: env["coordinator"].Generate(pb.GenerateRequest(text="hi", request_id=r), timeout=30), "request_id")
    assert env["coordinator"].Generate(pb.GenerateRequest(text="hi", request_id="req-1 ok"), timeout=30).request_id == "req-1 ok"


def test_regression_tiny_temperature_samples_the_argmax(env):
    # Was INTERNAL: logits / 1e-40 overflowed to inf, the softmax gave NaN, the target answered
    # token -1 and the draft's multinomial raised. The limit of a vanishing temperature is greedy.
    from specdec.maths.sampling import SamplingConfig, target_probs, truncated_probs

    logits = torch.tensor([1.0, 3.0, -2.0, 2.5])
    q = target_probs(logits, SamplingConfig(temperature=1e-40))
    assert torch.equal(q, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    ids, probs = truncated_probs(logits, 1e-40, 2)
    assert ids.tolist() == [1, 3] and probs.tolist() == [1.0, 0.0]
    assert torch.equal(target_probs(logits, SamplingConfig(temperature=0.7)), torch.softmax(logits / 0.7, dim=-1))  # sane ones untouched
    prompt = tiny.prompts(1, seed=8)[0]
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW, sampling=pb.SamplingParams(temperature=1e-40, seed=1)
    )
    assert list(env["coordinator"].Generate(request, timeout=30).token_ids) == tiny.reference_greedy(env["model"], prompt, MAX_NEW)


def test_regression_nan_and_bad_distributions_are_rejected(env):
    target, draft = env["target"], env["draft"]
    nan = float("nan")
    # Were INTERNAL (the draft's multinomial on NaN) or a reply with next_token -1 (the target).
    rejected(
        lambda: draft.Propose(pb.ProposeRequest(sequence_id="r1", append_tokens=[1, 2], max_tokens=2, temperature=nan), timeout=30),
        "temperature",
    )
    rejected(
        lambda: target.Verify(
            pb.VerifyRequest(sequence_id="r2", append_tokens=[1], sampling=pb.SamplingParams(temperature=nan)), timeout=30
        ),
        "sampling.temperature",
    )
    for ids, probs in (([5], [nan]), ([5, 6], [0.5, 0.25]), ([5, 5], [0.5, 0.5]), ([6], [1.0]), ([5], [math.inf])):
        dist = pb.SparseDistribution(token_ids=ids, probs=probs)
        rejected(
            lambda d=dist: target.Verify(
                pb.VerifyRequest(
                    sequence_id="r3", append_tokens=[1], draft_tokens=[5], draft_dists=[d], sampling=pb.SamplingParams(temperature=1.0)
                ),
                timeout=30,
            ),
            "draft_dists[0]",
        )


def test_regression_sequence_ids_and_lengths(env):
    target, draft = env["target"], env["draft"]
    # Was RESOURCE_EXHAUSTED: the error echoed a 100k-character id past gRPC's 16 KiB metadata limit.
    rejected(lambda: target.Verify(pb.VerifyRequest(sequence_id="x" * 100_000, known_len=3, append_tokens=[1]), timeout=30), "sequence_id")
    rejected(lambda: draft.Release(pb.DraftServiceReleaseRequest(sequence_id=""), timeout=30), "sequence_id")
    # Was NOT_FOUND, which makes a coordinator re-send: a negative length is the caller's mistake.
    rejected(lambda: target.Verify(pb.VerifyRequest(sequence_id="r4", known_len=-1, append_tokens=[1]), timeout=30), "known_len")
    # Was NOT_FOUND after creating an empty sequence that stayed allocated.
    held = len(env["stack"].servers[0].servicer.engine.store)
    rejected(lambda: target.Verify(pb.VerifyRequest(sequence_id="r5"), timeout=30), "append_tokens")
    rejected(lambda: draft.Propose(pb.ProposeRequest(sequence_id="r5", max_tokens=2), timeout=30), "append_tokens")
    assert len(env["stack"].servers[0].servicer.engine.store) == held


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("payload", [b"\xff\xff\xff", b"\x0a\x02\xff\xfe"], ids=["not-protobuf", "text-not-utf8"])
def test_regression_undecodable_requests_are_invalid_argument(env, method, payload):
    # Was UNKNOWN ("Unexpected DecodeError"): gRPC parsed the bytes before any handler ran. The
    # second payload is a request whose `text` (field 1: tag 0x0a, length 2) is not UTF-8.
    streaming = method == "GenerateStream"
    request_cls = pb.GenerateStreamRequest if streaming else pb.GenerateRequest
    with grpc.insecure_channel(env["addresses"]["coordinator"]) as channel:
        make = channel.unary_stream if streaming else channel.unary_unary
        rpc = make(f"/specdec.v1.CoordinatorService/{method}", request_serializer=None, response_deserializer=None)

        def call(data: bytes):
            result = rpc(data, timeout=30)
            return list(result) if streaming else result

        with pytest.raises(grpc.RpcError) as info:
            call(payload)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details().startswith("request:") and request_cls.DESCRIPTOR.full_name in info.value.details()
        violations = error_details_pb2.BadRequest()
        rpc_status.from_call(info.value).details[0].Unpack(violations)
        assert violations.field_violations[0].field == "request"
        # The same raw method with a well-formed request still generates.
        assert call(request_cls(text="hi", max_new_tokens=2).SerializeToString())
