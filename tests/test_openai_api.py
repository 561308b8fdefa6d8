"""The OpenAI-compatible API as its users meet it, with the official `openai` client: every field
honoured or refused by name, OpenAI's shapes (errors, usage chunks, Retry-After), log-probabilities
equal to the target's own, and the metrics a streamed request leaves behind.

The target here is a tiny model made to end its text often (its end-of-sequence row copies a
frequent token's), so ignore_eos and min_tokens have something to change."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from protos import specdec_pb2 as pb
from tests import tiny
from tests.stack import Stack

MODEL = "tiny"
PROMPTS = tiny.prompts(8, seed=5)


def eos_prone(target):
    """The target with its <eos> row a little above its most frequent greedy token's: it then ends
    most texts within a few tokens (prompts 0 and 1 after 7 and 13 tokens)."""
    with torch.no_grad():
        target.lm_head.weight[tiny.EOS] = target.lm_head.weight[81] * 1.05
    return target


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target, draft = tiny.tiny_pair(seed=0)
    target = eos_prone(target)
    folder = tmp_path_factory.mktemp("openai")
    stack = Stack()
    target_addr = stack.target(tiny.save(target, folder / "target"))
    draft_addr = stack.draft(drafter="model", model=tiny.save(draft, folder / "draft"))
    grpc_addr = stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer(), http_port=0, served_model_name=MODEL)
    base = f"http://127.0.0.1:{stack.servers[-1].http.port}"
    # A second coordinator with one running slot and one queue place, for the queue and 429 tests.
    stack.coordinator(target_addr, draft_addr, tiny.byte_tokenizer(), http_port=0, served_model_name=MODEL,
                      max_concurrent_requests=1, max_queue=1, max_streams_per_client=8)  # one test peer fills slot and queue
    small = stack.servers[-1]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    yield {"base": base, "client": client, "target": target, "stack": stack, "small": small, "grpc": grpc_addr}
    stack.stop()


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, method="POST", data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def scrape(base: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            out.append((name, dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out


def metric(samples, name: str, **labels) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


@torch.inference_mode()
def reference(target, prompt: list[int], max_new: int, **generate_kwargs) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=tiny.EOS, **generate_kwargs)
    return out[0, len(prompt):].tolist()


# --- 1. and 2.: metrics ---


def test_a_streamed_request_counts_one_success(env):
    before = scrape(env["base"])
    stream = env["client"].completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    after = scrape(env["base"])
    grew = metric(after, "specdec:request_success_total") - metric(before, "specdec:request_success_total")
    e2e = metric(after, "specdec:e2e_request_latency_seconds_count") - metric(before, "specdec:e2e_request_latency_seconds_count")
    assert grew == 1, "a streamed request must count once as a success"
    assert e2e in (0, 1)  # where the histogram exists, it agrees with the success count


def test_queue_depth_gauge_and_retry_after(env):
    """One slot held, one request queued (the gauge says 1), one more refused: 429 with Retry-After."""
    small = env["small"]
    base = f"http://127.0.0.1:{small.http.port}"
    loop = env["stack"].loop
    release = asyncio.run_coroutine_threadsafe(_make_event(), loop).result()

    async def hold():
        async with small.servicer.admission.slot():
            await release.wait()

    holder = asyncio.run_coroutine_threadsafe(hold(), loop)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 3, "temperature": 0}
    queued = loop.run_in_executor(None, post, f"{base}/v1/completions", body)
    try:
        for _ in range(200):
            if metric(scrape(base), "specdec:num_requests_waiting") == 1:
                break
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result()
        assert metric(scrape(base), "specdec:num_requests_waiting") == 1
        status, headers, refused = post(f"{base}/v1/completions", body)
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert refused["error"]["type"] == "rate_limit_error" and refused["error"]["code"] == "rate_limit_exceeded"
    finally:
        loop.call_soon_threadsafe(release.set)
        holder.result(timeout=30)
    status, _, done = asyncio.run_coroutine_threadsafe(_wrap(queued), loop).result(timeout=60)
    assert status == 200 and done["usage"]["completion_tokens"] == 3
    assert metric(scrape(base), "specdec:num_requests_waiting") == 0


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


async def _wrap(future):
    return await future


# --- 3.: every field honoured or refused ---


def test_logprobs_are_the_targets_own(env):
    """Greedy: the plain log-softmax at each position; sampled: after temperature and top-k, as
    transformers' own warpers compute them (vLLM's processed log-probabilities)."""
    target, prompt = env["target"], PROMPTS[5]
    result = env["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    generated = reference(target, prompt, 8, eos_token_id=tiny.EOS)
    assert len(lp.token_logprobs) == len(generated) == result.usage.completion_tokens
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, token in enumerate(generated):
        assert lp.token_logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-4)
        top = torch.topk(expected[i], 3).values.tolist()  # keyed by token text: bytes that decode alike share a key
        assert all(any(v == pytest.approx(t, abs=1e-4) for t in top) for v in lp.top_logprobs[i].values())
    assert lp.tokens == [tiny.byte_tokenizer().decode([t]) for t in generated]

    # Chat reports the alternatives as a list, so every one can be checked.
    messages = [{"role": "user", "content": "abc"}]
    chat = env["client"].chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                                 top_logprobs=2)
    content = chat.choices[0].logprobs.content
    chat_prompt = tiny.byte_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    generated = reference(target, chat_prompt, 6, eos_token_id=tiny.EOS)
    assert len(content) == len(generated) == chat.usage.completion_tokens
    with torch.inference_mode():
        expected = torch.log_softmax(target(torch.tensor([chat_prompt + generated])).logits[0, len(chat_prompt) - 1 : -1].float(), -1)
    for i, token in enumerate(generated):
        assert content[i].logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        assert [t.logprob for t in content[i].top_logprobs] == pytest.approx(torch.topk(expected[i], 2).values.tolist(), abs=1e-4)
        assert bytes(content[i].bytes).decode("utf-8", "replace") == content[i].token

    # Sampled, over gRPC (token ids exact, where text would merge bytes): re-scored with transformers' warpers.
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    response = env["stack"].client(env["grpc"]).Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), max_new_tokens=12, ignore_eos=True, logprobs=1,
        sampling=pb.SamplingParams(temperature=0.7, top_k=5, seed=3)), timeout=60)
    ids = list(response.token_ids)
    assert [lp.token_id for lp in response.logprobs] == ids and len(ids) == 12
    seq = prompt + ids
    with torch.inference_mode():
        logits = target(torch.tensor([seq])).logits[0]
    for i, token in enumerate(ids):
        scores = torch.log_softmax(warp(torch.tensor([seq[: len(prompt) + i]]), logits[len(prompt) + i - 1][None].float()), -1)[0]
        assert response.logprobs[i].logprob == pytest.approx(scores[token].item(), abs=1e-4)
        assert response.logprobs[i].top_logprobs[0] == pytest.approx(scores.max().item(), abs=1e-4)


def test_ignore_eos_and_min_tokens_match_transformers(env):
    """ignore_eos: exactly max_tokens tokens; min_tokens: no <eos> before them. Greedy output equals
    transformers' generate() with the same rule (no eos; min_new_tokens)."""
    target, prompt = env["target"], PROMPTS[1]
    plain = env["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 30  # this target stops early
    full = env["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 30 and full.choices[0].finish_reason == "length"
    text = tiny.byte_tokenizer().decode(reference(target, prompt, 30, eos_token_id=None), skip_special_tokens=True)
    assert full.choices[0].text == text
    low = env["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body={"min_tokens": 20})
    expected = reference(target, prompt, 30, eos_token_id=tiny.EOS, min_new_tokens=20)
    expected = expected[: expected.index(tiny.EOS) + 1] if tiny.EOS in expected else expected
    assert low.usage.completion_tokens == len(expected) >= 20
    assert low.choices[0].text == tiny.byte_tokenizer().decode(expected, skip_special_tokens=True)


def test_min_tokens_holds_when_sampling(env):
    for seed in range(6):
        r = env["client"].completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=seed,
                                             extra_body={"min_tokens": 10})
        assert r.usage.completion_tokens >= 10


def test_echo_puts_the_prompt_first(env):
    r = env["client"].completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("hello") and len(r.choices[0].text) > len("hello")
    chunks = list(env["client"].completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize("kwargs,param,code", [
    ({"response_format": {"type": "json_object"}}, "response_format", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "invalid_value"),
    ({"presence_penalty": 0.5}, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "invalid_value"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "invalid_value"),
    ({"n": 2}, "n", "invalid_value"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"extra_body": {"guided_json": {}}}, "guided_json", "unknown_parameter"),
    ({"temperature": -1}, "temperature", "invalid_value"),
    ({"max_completion_tokens": 10**12}, "max_completion_tokens", "invalid_value"),
    ({"seed": -3}, "seed", "invalid_value"),
    ({"store": True}, "store", "invalid_value"),
])
def test_unsupported_chat_fields_are_refused_by_name(env, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        env["client"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kwargs)
    error = info.value.body if isinstance(info.value.body, dict) and "param" in info.value.body else info.value.body["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"


def test_what_the_client_sends_when_told_not_to_store_is_accepted(env):
    """store=false and metadata, as a program using the official client may set them: nothing is
    stored, so they change nothing (store=true is refused above)."""
    chat = env["client"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                                 temperature=0, store=False, metadata={"team": "a"})
    plain = env["client"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                                  temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].message.content


def test_an_unknown_model_is_404(env):
    with pytest.raises(openai.NotFoundError) as info:
        env["client"].completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    body = info.value.body
    body = body.get("error", body)
    assert body["code"] == "model_not_found" and body["param"] == "model"


def test_malformed_bodies_are_400_not_500(env):
    url = f"{env['base']}/v1/completions"
    for raw, param in [(b"\xff\xfe", "body"), (b"[" * 100_000, "body"), (b'{"prompt": "\\ud800"}', "body"),
                       (json.dumps({"prompt": "x", "stop": 5}).encode(), "stop"),
                       (json.dumps({"prompt": "x", "stop": {"a": 1}}).encode(), "stop"),
                       (json.dumps({"prompt": "x", "top_k": 2**40}).encode(), "top_k"),
                       (b'{"prompt": "x", "temperature": 1e400}', "temperature")]:
        status, _, body = post(url, raw)
        assert status == 400 and body["error"]["param"] == param, (raw[:40], body)


def test_a_bad_token_id_is_named_as_such(env):
    """A negative id fails the token-id branch of the prompt's union: that branch's complaint is the
    message, not the text branch's "should be a valid string"; /detokenize refuses an id past the
    vocabulary instead of decoding it to nothing."""
    status, _, body = post(f"{env['base']}/v1/completions", {"prompt": [3, -5], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt[1]" and "greater than or equal to 0" in body["error"]["message"]
    status, _, body = post(f"{env['base']}/detokenize", {"tokens": [3, 10**6]})
    assert status == 400 and body["error"]["param"] == "tokens" and "1000000" in body["error"]["message"], body


# --- 4.: shapes ---


def test_usage_chunk_only_when_asked(env):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0, stream=True)
    plain = list(env["client"].completions.create(**kwargs))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)
    asked = list(env["client"].completions.create(stream_options={"include_usage": True}, **kwargs))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in asked[:-1])
    chat = list(env["client"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                                      temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.total_tokens == chat[-1].usage.prompt_tokens + 3


def test_error_envelopes_models_version_tokenize(env):
    base = env["base"]
    for url, method, status in [(f"{base}/nowhere", "GET", 404), (f"{base}/v1/completions", "GET", 405)]:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10)
        error = json.loads(info.value.read())["error"]
        assert info.value.code == status and error["code"] in ("not_found", "method_not_allowed") and error["message"]
    model = env["client"].models.list().data[0]
    assert model.id == MODEL and model.created > 0 and model.model_extra["max_model_len"] == 512
    assert model.model_extra["numerics"] == "exact"  # the target serves through specdec's CPU kernel
    version = json.loads(urllib.request.urlopen(f"{base}/version", timeout=10).read())["version"]
    assert re.match(r"\d+\.\d+", version)
    status, _, tokens = post(f"{base}/tokenize", {"prompt": "abc"})
    assert status == 200 and tokens["tokens"] == tiny.byte_tokenizer()("abc", add_special_tokens=False)["input_ids"]
    assert post(f"{base}/detokenize", {"tokens": tokens["tokens"]})[2]["prompt"] == "abc"
    doc = json.loads(urllib.request.urlopen(f"{base}/openapi.json", timeout=10).read())
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"logprobs", "top_logprobs", "ignore_eos", "min_tokens", "stream_options", "response_format"} <= set(props)


# --- 5. and 6.: context limit, request ids ---


def test_context_limit(env):
    """The tiny target's context is 512 tokens: prompt + max_tokens past it is refused, naming
    max_tokens; an unset max_tokens shrinks to what the context leaves."""
    prompt = list(range(1, 250)) * 2  # 498 tokens
    with pytest.raises(openai.BadRequestError) as info:
        env["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    body = info.value.body.get("error", info.value.body)
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    status, _, body = post(f"{env['base']}/v1/completions", {"prompt": list(range(1, 250)) * 3, "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "prompt"
    status, _, body = post(f"{env['base']}/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x" * 490}], "temperature": 0, "extra": None} | {})
    assert status == 400 and body["error"]["code"] == "unknown_parameter"
    status, _, body = post(f"{env['base']}/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x" * 490}], "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["total_tokens"] == 512


def test_request_id_in_and_out_and_in_the_logs(env, capfd):
    status, headers, body = post(f"{env['base']}/v1/completions", {"prompt": "abc", "max_tokens": 2},
                                 headers={"X-Request-Id": "trace-42"})
    assert status == 200 and headers["x-request-id"] == "trace-42" and body["id"] == "cmpl-trace-42"
    out = capfd.readouterr()
    assert re.search(r"request started.*trace-42|trace-42.*request started", out.out + out.err)
    status, headers, _ = post(f"{env['base']}/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert status == 200 and len(headers["x-request-id"]) >= 16
    status, _, body = post(f"{env['base']}/v1/completions", {"prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "x" * 200})
    assert status == 400 and body["error"]["param"] == "X-Request-Id"
