"""Predicted outputs (GenerateRequest.prediction, the chat API's `prediction`): the target's prompt
lookup drafts from the prediction as well as from the sequence's own tokens.

The tokens must be the target's own whatever the prediction says; a prediction of the target's own
output must save forward passes; the source must survive a rollback and a lost sequence re-filled;
a bad one must be refused naming its field.
"""

from __future__ import annotations

import pytest

from specdec.errors import InvalidArgument
from specdec.limits import MAX_LOOKUP_SOURCE
from specdec.maths.lookup import NgramIndex
from specdec.calls.request import VerifyCall
from tests import tiny
from tests.test_lookup_ahead import GREEDY, RecordingVerifier, engine, ngram_loop
from tests.test_loop import run

AHEAD = 24


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=5)


def test_the_index_drafts_from_its_source_and_the_sequence_s_own_tokens_come_first():
    index = NgramIndex(4, 1, source=(1, 2, 3, 4, 5))
    index.extend([9, 1, 2])
    assert len(index) == 3 and index.tokens == [9, 1, 2]  # the source is not the sequence's
    assert index.propose(8) == ([3, 4, 5], 2 + 4)  # the source's continuation, as far as it goes (n + max_n)
    index.extend([7, 1, 2])
    assert index.propose(2) == ([7, 1], 2)  # the sequence's own later occurrence wins
    index.crop(-4)  # rolled back to [9, 1]: (1, 2) -> the source again
    index.extend([2])
    assert index.propose(3) == ([3, 4, 5], 2 + 4)
    assert NgramIndex(4, 1).propose(3) == ([], 0)


def test_a_prediction_s_matches_are_learned_apart_from_the_sequence_s_own(pair):
    """A source match reports n + max_n, so the target learns its chances in their own rows: a
    workload of bad predictions must not cut the drafts of requests that draft from their own text."""
    index = NgramIndex(4, 1, source=(1, 2, 3))
    index.extend([1, 2])
    assert index.propose(1) == ([3], 6)  # the 2-gram (1, 2), in the source
    target = engine(pair)
    own = target.calibration.survival(2, 3)
    for _ in range(100):
        target.calibration.observe(6, [3, 4], [5])
    assert target.calibration.survival(2, 3) == own and target.calibration.survival(6, 1)[0] < 0.1


def test_a_prediction_of_the_target_s_own_output_saves_passes_and_changes_no_token(pair):
    target = engine(pair)
    prompts = tiny.prompts(4, seed=41)
    passes = {"none": 0, "own": 0, "wrong": 0}
    for n, prompt in enumerate(prompts):
        reference = tiny.reference_greedy(pair[0], prompt, AHEAD + 1)
        wrong = tiny.prompts(1, seed=100 + n)[0] * 3
        for name, source in (("none", ()), ("own", tuple(reference)), ("wrong", tuple(wrong))):
            out = target.verify(VerifyCall(f"{name}{n}", 0, prompt, [], [], GREEDY, decode_ahead=AHEAD, lookup_draft_length=8,
                                           lookup_source=source))
            got = [out.next_token, *out.decoded]
            assert got == reference[:len(got)] and len(got) == AHEAD + 1 or tiny.EOS in got
            assert out.predicted_accepted <= out.predicted_drafted <= out.ahead_drafted and out.predicted_accepted <= out.ahead_accepted
            assert (out.predicted_drafted > 0) == (name != "none") or name == "wrong"
            passes[name] += 1 + out.ahead_passes
    assert passes["own"] < passes["none"] / 2, passes


def test_the_loop_sends_the_prediction_once_and_again_to_a_target_that_lost_the_sequence(pair):
    prompt = tiny.prompts(1, seed=43)[0]
    reference = tiny.reference_greedy(pair[0], prompt, 24)
    prediction = tuple(reference)
    verifier = RecordingVerifier(engine(pair))
    tokens, with_prediction = run(ngram_loop(verifier, lookup=True), prompt, draft_length=8, prediction_ids=prediction)
    assert tokens == reference
    sent = [call for call in verifier.calls if call.lookup_source]
    assert len(sent) == 1 and sent[0].known_len == 0 and sent[0].lookup_source == prediction
    tokens, without = run(ngram_loop(RecordingVerifier(engine(pair)), lookup=True), prompt, draft_length=8)
    assert tokens == reference and with_prediction.steps < without.steps

    class Evicting(RecordingVerifier):  # loses the sequence before its second call, as a restarted target would
        async def verify(self, call):
            if len(self.calls) == 1:
                for sequence_id in list(self.engine.store._sequences):
                    self.engine.store.release(sequence_id, retire=False)
            return await super().verify(call)

    evicting = Evicting(engine(pair))
    tokens, _ = run(ngram_loop(evicting, lookup=True), prompt, draft_length=8, prediction_ids=prediction)
    assert tokens == reference
    refills = [call for call in evicting.calls if call.known_len == 0]
    assert len(refills) == 2 and all(call.lookup_source == prediction for call in refills)


@pytest.mark.parametrize("source", [(1, 10**6), (0,) * (MAX_LOOKUP_SOURCE + 1)])
def test_a_bad_source_is_invalid_argument_naming_it(pair, source):
    with pytest.raises(InvalidArgument) as info:
        engine(pair)._prepare(VerifyCall("x", 0, [1, 2], [], [], GREEDY, lookup_draft_length=4, lookup_source=source))
    assert info.value.field == "lookup_source"


@pytest.fixture(scope="module")
def ngram_stack(pair, tmp_path_factory):
    """A target and a coordinator drafting n-grams (the target by lookup), with the HTTP API."""
    from tests.stack import Stack

    stack = Stack()
    address, base = stack.tiny_ngram(tiny.save(pair[0], tmp_path_factory.mktemp("prediction") / "target"), max_prompt_chars=4096)
    yield stack, stack.client(address), base, address
    stack.stop()


def test_through_the_services_a_good_prediction_takes_fewer_steps_for_the_same_tokens(ngram_stack):
    import grpc

    from protos import specdec_pb2 as pb

    stack, client, base, _ = ngram_stack
    plain = client.Generate(pb.GenerateRequest(text="hello there", max_new_tokens=24, ignore_eos=True), timeout=60)
    predicted = client.Generate(pb.GenerateRequest(text="hello there", max_new_tokens=24, ignore_eos=True,
                                                   prediction=plain.text), timeout=60)
    assert list(predicted.token_ids) == list(plain.token_ids) and predicted.text == plain.text
    assert predicted.stats.steps < plain.stats.steps, (predicted.stats, plain.stats)
    s = predicted.stats  # the prediction's drafts counted apart, among all drafts
    assert 0 < s.accepted_prediction_tokens <= s.prediction_tokens <= s.draft_tokens and s.accepted_prediction_tokens <= s.accepted_tokens
    assert plain.stats.prediction_tokens == 0
    with pytest.raises(grpc.RpcError) as info:
        client.Generate(pb.GenerateRequest(text="hi", max_new_tokens=4, prediction="x" * 5000), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("prediction:")


def test_the_chat_api_takes_openai_s_prediction_field(ngram_stack):
    import json
    import urllib.request

    stack, client, base, _ = ngram_stack

    def chat(**extra):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, **extra}
        request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, plain = chat()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]
    for prediction in ({"type": "content", "content": text}, {"type": "content", "content": [{"type": "text", "text": text}]}):
        status, predicted = chat(prediction=prediction)
        assert status == 200 and predicted["choices"][0]["message"]["content"] == text
        details, spec = predicted["usage"]["completion_tokens_details"], predicted["speculation"]
        assert details["accepted_prediction_tokens"] == spec["accepted_prediction_tokens"] > 0
        assert details["rejected_prediction_tokens"] == spec["prediction_tokens"] - spec["accepted_prediction_tokens"] >= 0
    status, refused = chat(prediction={"type": "image", "content": "x"})
    assert status == 400 and refused["error"]["param"].startswith("prediction"), refused


def test_specdec_generate_takes_a_prediction_from_a_file(ngram_stack, tmp_path):
    import re
    import subprocess
    import sys

    address = ngram_stack[3]

    def generate(*flags: str) -> tuple[str, int, str]:
        done = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "generate", "--raw", "--max-new-tokens", "24",
                               "--address", address, "hello there", *flags], capture_output=True, text=True, timeout=120)
        steps = re.search(r"steps (\d+)", done.stderr)  # the statistics line goes to stderr, the text to stdout
        return done.stdout, int(steps.group(1)) if steps else -1, done.stderr

    text, steps, _ = generate()
    (tmp_path / "prediction.txt").write_text(text)
    predicted, fewer, _ = generate("--prediction", f"@{tmp_path / 'prediction.txt'}")
    assert predicted == text and 0 < fewer < steps, (text, predicted, steps, fewer)
    _, _, error = generate("--prediction", f"@{tmp_path / 'missing.txt'}")
    assert "--prediction @" in error and "No such file" in error
