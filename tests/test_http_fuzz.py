"""Property-based fuzzing (hypothesis) of the OpenAI-compatible HTTP API, on tiny models.

Bodies are OpenAI requests with a few fields given random JSON of any type, numbers only raw JSON
text can carry (1e400, NaN, Infinity, integers of hundreds of digits), broken escapes and lone
surrogates, invalid UTF-8, unknown keys, missing required fields, nesting thousands deep, JSON that
is not an object, truncated JSON and random bytes. Over two thousand of them, against both
/v1/completions and /v1/chat/completions, streamed or not, sometimes with a random X-Request-Id:
  * no status is 500 or above (those mean a bug);
  * every 4xx carries OpenAI's envelope, {"error": {"message", "type", "param", "code"}};
  * a 200 is a completion (or server-sent events ending in [DONE] with no server error in them);
  * enough of the bodies are valid that generation runs too, not only the validation.
The coordinator allows MAX_NEW tokens per request, so each valid request is cheap. A summary of
the statuses is printed; run with -s to see it.
"""

from __future__ import annotations

import collections
import json

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import tiny
from tests.stack import Stack

MAX_NEW = 2
EXAMPLES = 1050  # per endpoint
FUZZ = settings(deadline=None, database=None, max_examples=EXAMPLES, suppress_health_check=list(HealthCheck))
ENVELOPE = {"message", "type", "param", "code"}

STATUS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # endpoint -> status -> bodies


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    stack = Stack()
    _, base, _ = stack.tiny_speculative(tmp_path_factory.mktemp("http-fuzz"), served_model_name="tiny", max_new_tokens=MAX_NEW,
                                        default_max_new_tokens=MAX_NEW)
    client = httpx2.Client(base_url=base, timeout=60)  # one kept-alive connection
    yield {"client": client, "stack": stack}
    client.close()
    stack.stop()


# --- JSON the standard library cannot write: raw text spliced into the body ------------------------


class Raw(str):
    """JSON text put into the body as it is."""


def to_json(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{to_json(k) if isinstance(k, Raw) else json.dumps(k)}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value)  # NaN and Infinity for the floats JSON has no word for, \ud800 for lone surrogates


RAW_NUMBERS = st.sampled_from([
    "1e400", "-1e400", "1e-400", "NaN", "-NaN", "Infinity", "-Infinity", "inf", "-0", "0.0", "1.0", "0.5", "1E2", "2e0",
    "2147483647", "2147483648", "-2147483649", "4294967296", "18446744073709551615", "18446744073709551616", "9" * 400,
    "-" + "9" * 400, "0." + "0" * 400 + "1", "01", "+1", ".5", "0x10", "1e", "--1",
]).map(Raw)
RAW_STRINGS = st.sampled_from([
    r'"\ud800"', r'"\udfff\ud800"', r'"\u00"', r'"\x41"', r'"\q"', '"tab\there"', '"\x00"', r'"\u0000"', '"unterminated',
]).map(Raw)
HUGE_STRING = st.builds(lambda c, n: c * n, st.characters(), st.integers(1000, 100_000))
LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20), RAW_NUMBERS,
    RAW_STRINGS, HUGE_STRING,
)
ANY_JSON = st.recursive(LEAF, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                        max_leaves=12)

# --- OpenAI requests, each field valid or replaced by anything ----------------------------------------

TOKEN = st.integers(0, tiny.VOCAB - 1)
TEXT = st.text(min_size=1, max_size=20)
STOP = st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3))
SHARED = {
    "model": st.sampled_from(["tiny", None]) | st.text(max_size=10),
    "max_tokens": st.integers(1, MAX_NEW),
    "temperature": st.sampled_from([0.0, 0, 1.0]) | st.floats(0.0, 2.0),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.sampled_from([1, 2]) | st.integers(-1, 50),
    "seed": st.integers(0, 2**64 - 1),
    "stop": STOP,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "presence_penalty": st.just(0.0),
    "frequency_penalty": st.just(0),
    "logit_bias": st.just({}),
    "user": st.text(max_size=10),
    "min_tokens": st.integers(0, MAX_NEW),
    "ignore_eos": st.booleans(),
    "draft_length": st.integers(0, 8),
    "adaptive": st.booleans(),
}
COMPLETION = {
    **SHARED,
    "prompt": st.one_of(TEXT, st.lists(TOKEN, min_size=1, max_size=20), st.lists(TEXT, min_size=1, max_size=1),
                        st.lists(st.lists(TOKEN, min_size=1, max_size=20), min_size=1, max_size=1)),
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "best_of": st.just(1),
    "suffix": st.just(""),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), min_size=1, max_size=2)},
    optional={"name": st.text(max_size=5)},
)
CHAT = {
    **SHARED,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, MAX_NEW),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "response_format": st.just({"type": "text"}),
    "tools": st.just([]),
    "tool_choice": st.just("none"),
    "parallel_tool_calls": st.booleans(),
}


@st.composite
def request_object(draw, fields: dict, required: str) -> dict:
    """A request with its required field and max_tokens, some optional fields, and a drawn few (often
    none) of them replaced by anything, dropped, or joined by an unknown key."""
    body = {required: draw(fields[required]), "max_tokens": draw(fields["max_tokens"])}
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=6)):
        body[name] = draw(fields[name])
    if "max_completion_tokens" in body and draw(st.booleans()):
        body.pop("max_tokens")  # both are refused; one is a valid request
    for name in draw(st.sets(st.sampled_from(sorted(fields)), min_size=(n := draw(st.sampled_from([0, 0, 0, 1, 2]))), max_size=n)):
        body[name] = draw(ANY_JSON)
    if draw(st.integers(0, 15)) == 0:
        body.pop(required)
    if draw(st.integers(0, 15)) == 0:
        body[draw(st.text(max_size=12))] = draw(ANY_JSON)
    return body


def _encode(text: str, raw_utf8: bool) -> bytes:
    # As UTF-8 proper, or with surrogates passed through as the invalid bytes they make.
    return text.encode("utf-8", "surrogatepass") if raw_utf8 else text.encode("utf-8")


@st.composite
def body_bytes(draw, fields: dict, required: str) -> bytes:
    kind = draw(st.sampled_from(["request"] * 12 + ["non-ascii", "bytes", "nested", "not-object", "truncated", "bad-utf8"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "nested":
        depth = draw(st.integers(1, 20_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('{"prompt":[', "]}")]))
        return (opener * depth + "1" + closer * depth).encode()
    if kind == "not-object":
        return to_json(draw(ANY_JSON)).encode("utf-8", "surrogatepass")
    obj = draw(request_object(fields, required))
    text = to_json(obj)
    if kind == "non-ascii":  # the same request with its strings as raw UTF-8 (lone surrogates included)
        return _encode(json.dumps(obj, ensure_ascii=False) if not _has_raw(obj) else text, raw_utf8=True)
    data = text.encode("utf-8")
    if kind == "truncated":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "bad-utf8":  # bytes that are not UTF-8 inside the body, most likely within a string
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + data[at:]
    return data


def _has_raw(value) -> bool:
    if isinstance(value, Raw):
        return True
    if isinstance(value, dict):
        return any(_has_raw(k) or _has_raw(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_raw(v) for v in value)
    return False


# Latin-1 header text, as HTTP carries it (no DEL or controls, no space at either end of a value).
HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=150).map(str.strip)
REQUEST_ID = st.none() | st.none() | st.none() | HEADER_TEXT


# --- the checks -----------------------------------------------------------------------------------


def not_json(constant: str):
    raise AssertionError(f"{constant} is not JSON")


def post(env, path: str, body: bytes, request_id: str | None) -> None:
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id.encode("latin-1")
    response = env["client"].post(path, content=body, headers=headers)
    status = response.status_code
    STATUS[path][status] += 1
    context = f"{path} {status}: {response.text[:500]!r}\nbody: {body[:1000]!r}"
    assert status < 500, context
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == ENVELOPE, context
        assert isinstance(error["message"], str) and isinstance(error["type"], str) and isinstance(error["code"], str), context
        assert error["param"] is None or isinstance(error["param"], str), context
        return
    assert status == 200, context
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", context
        for event in events[:-1]:
            chunk = json.loads(event, parse_constant=not_json)  # strict JSON: a JavaScript client's JSON.parse must read it
            assert "error" not in chunk or chunk["error"]["type"] != "server_error", context
        return
    completion = json.loads(response.text, parse_constant=not_json)
    assert completion["choices"] and completion["usage"]["completion_tokens"] <= MAX_NEW, context


@settings(FUZZ)
@given(body=body_bytes(COMPLETION, "prompt"), request_id=REQUEST_ID)
def test_fuzz_completions(env, body, request_id):
    post(env, "/v1/completions", body, request_id)


@settings(FUZZ)
@given(body=body_bytes(CHAT, "messages"), request_id=REQUEST_ID)
def test_fuzz_chat_completions(env, body, request_id):
    post(env, "/v1/chat/completions", body, request_id)


# --- regressions: what the fuzzer found, pinned down ---------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,fields", [("/v1/completions", {"prompt": "hello", "logprobs": 5}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                                   "top_logprobs": 5})])
def test_regression_truncated_alternatives_have_json_logprobs(env, path, fields, stream):
    # Was a 500 (streamed: "-Infinity", which no strict JSON parser reads): with top_k 1, the other
    # alternatives have log-probability -inf, which JSON cannot write. Now -9999.0, as OpenAI and vLLM say.
    body = {**fields, "max_tokens": MAX_NEW, "temperature": 1.0, "top_k": 1, "seed": 3, "stream": stream}
    response = env["client"].post(path, json=body)
    assert response.status_code == 200, response.text
    assert "-9999.0" in response.text
    payloads = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e and e != "data: [DONE]"] if stream else [response.text]
    for payload in payloads:
        json.loads(payload, parse_constant=not_json)


def test_zz_summary_and_still_serving(env):
    """Runs after the properties: enough bodies were sent, enough of them ran, and the API still works."""
    print("\nHTTP fuzzing summary (bodies per endpoint and their statuses):")
    for path, counts in sorted(STATUS.items()):
        print(f"  {path:<22} {sum(counts.values()):>5} bodies  " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items())))
    total = sum(sum(counts.values()) for counts in STATUS.values())
    assert total >= 2000, f"only {total} bodies were sent"
    for path, counts in STATUS.items():
        assert counts[200] >= 0.1 * sum(counts.values()), f"{path}: too few valid bodies to reach generation: {dict(counts)}"
    response = env["client"].post("/v1/completions", json={"prompt": "hello", "max_tokens": MAX_NEW, "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
