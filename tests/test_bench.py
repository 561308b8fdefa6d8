"""`specdec bench --quick`: the whole benchmark pipeline on tiny models, its JSON and plots checked."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "bench", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), out, done.stdout


@pytest.mark.slow  # a whole `bench --quick` run: test-all (the suite\'s time, issue 58)
def test_every_configuration_ran_on_both_prompt_sets(document):
    doc, _, _ = document
    names = {r["configuration"] for r in doc["results"]}
    assert {"hf", "specdec-off", "hf-assisted[ngram]", "specdec-local[ngram]", "specdec-grpc[ngram]",
            "hf-assisted[draft]", "specdec-local[draft]", "specdec-grpc[draft]"} <= names
    assert {r["prompt_set"] for r in doc["results"]} == {"chat", "grounded"}
    assert doc["command"].startswith("specdec bench") and doc["machine"]["cores"] >= 1


@pytest.mark.slow  # a whole `bench --quick` run: test-all (the suite\'s time, issue 58)
def test_greedy_output_is_identical_in_every_configuration(document):
    doc, _, _ = document
    for r in doc["results"]:
        ident = r["identical_to_baseline"]
        assert ident["identical"] == ident["runs"] > 0, r["configuration"]


@pytest.mark.slow  # a whole `bench --quick` run: test-all (the suite\'s time, issue 58)
def test_records_carry_rates_splits_and_predictions(document):
    doc, _, stdout = document
    for r in doc["results"]:
        t = r["tokens_per_second"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
        if r["kind"] == "hf":
            assert r["speedup_vs_hf"] == pytest.approx(1.0)
        if r["kind"].startswith("specdec"):
            assert sum(r["time_split"].values()) == pytest.approx(1.0, abs=0.02)
            assert 0 <= r["overhead_share"] < 1 and 0 <= r["request_overhead_share"] < 1
            assert r["wire_per_step_seconds"] >= 0 and r["coordination_per_step_seconds"] >= 0
            # Measured over predicted: two rates timed at different moments, which a busy machine put
            # 82x apart in a clean-clone `make test`. Any positive number is a report; the
            # predictions themselves are checked on fixed costs (tests/test_plan.py).
            assert r["predicted_decode_tokens_per_second"] > 0 and 0 < r["efficiency"] < math.inf
            assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["mean_accepted_length"] >= 1.0
            ttft = r["time_to_first_token_seconds"]
            assert 0 < ttft["median"] <= ttft["max"] < r["seconds"]
        if r["kind"] == "specdec-grpc":  # n-gram inside the coordinator: the Verify hop only
            assert r["wire_bytes_per_step"] > 0 and r["model"]["hops"] == (1 if "in-coordinator" in r["configuration"] else 2)
    assert "specdec-grpc[ngram,in-coordinator]" in {r["configuration"] for r in doc["results"]}
    assert doc["rtt_seconds"] > 0 and doc["cost_curve_seconds"]["1"] > 0
    assert set(doc["cost_curve_seconds_by_set"]) == set(doc["prompts"])
    for r in doc["results"]:  # each prediction carries the curve measured around its own passes
        if "model" in r:
            assert r["model"]["cost_curve_seconds"]["1"] > 0 and r["model"]["cost_curve_seconds"] != doc["cost_curve_seconds"]
    assert "prompt set: chat" in stdout and "efficiency" in stdout


@pytest.mark.slow  # a whole `bench --quick` run: test-all (the suite\'s time, issue 58)
def test_plots_are_written(document):
    _, out, _ = document
    for name in ("tokens_per_second.png", "speedup_vs_draft_length.png", "acceptance_by_position.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a whole `bench --quick` run: test-all (the suite\'s time, issue 58)
def test_chain_tree_and_staged_side_by_side(document):
    doc, _, stdout = document
    names = {r["configuration"] for r in doc["results"]}
    assert {"tree[draft,n=16,g=8]", "tree-grpc[draft,n=16,g=8]", "staged[draft,g=2]"} <= names
    grpc_tree = next(r for r in doc["results"] if r["configuration"] == "tree-grpc[draft,n=16,g=8]")
    assert grpc_tree["wire_bytes_per_step"] > 0 and grpc_tree["draft_tokens"] > grpc_tree["steps"]  # trees crossed the wire
    rows = doc["chain_tree_staged"]
    assert {r["kind"] for r in rows} == {"chain (best)", "tree", "staged"}
    for r in rows:
        assert r["tokens_per_step"] >= 1.0 and r["tokens_per_second"] > 0
        assert r["identical"]["identical"] == r["identical"]["runs"] > 0
    assert "chain vs tree vs staged" in stdout


def test_the_categories_set_splits_into_its_six_kinds_of_task():
    """`--per-kind`: each kind of prompt is a set of its own, so a kind where speculation costs is
    not hidden by one where it pays."""
    import json

    from specdec_tools.bench import by_kind
    from specdec_tools.workload import prompt_path

    items = [(json.loads(line)["id"], [i]) for i, line in enumerate(prompt_path("categories").read_text().splitlines())]
    kinds = by_kind({"categories": items})
    assert sorted(kinds) == [f"categories:{k}" for k in ("conversation", "math", "qa", "rag", "summarization", "translation")]
    assert all(len(v) == 2 for v in kinds.values()) and sum(len(v) for v in kinds.values()) == len(items)
