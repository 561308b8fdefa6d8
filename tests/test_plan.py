"""The analytic model (specdec_tools.plan) and the `specdec plan` command."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from specdec.maths.costs import expected_tokens
from specdec_tools import plan

CURVE = plan.CostCurve.parse("1:44,2:70,4:67,8:70,16:85")


def test_expected_tokens_closed_form_matches_a_simulation():
    rng = random.Random(0)
    for a, g in ((0.3, 2), (0.7, 4), (0.9, 8)):
        steps = 20000
        total = 0
        for _ in range(steps):
            accepted = 0
            while accepted < g and rng.random() < a:
                accepted += 1
            total += accepted + 1  # plus the target's own token
        assert total / steps == pytest.approx(expected_tokens(a, g), rel=0.02)
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert plan.expected_tokens_fractional(0.5, 2) == pytest.approx(1.75)


def test_cost_curve_interpolates_and_extrapolates():
    assert CURVE(1) == pytest.approx(0.044) and CURVE(3) == pytest.approx(0.0685)
    assert CURVE(32) == pytest.approx(0.085 + (0.085 - 0.070) * 16 / 8)
    assert CURVE(1.5) == pytest.approx(0.057)
    with pytest.raises(ValueError, match="V\\(1\\)"):
        plan.CostCurve.parse("2:70,4:67")
    with pytest.raises(ValueError, match="n:ms pairs"):
        plan.CostCurve.parse("1:44,two:70")


def test_acceptance_from_steps_inverts_expected_tokens():
    for a in (0.0, 0.2, 0.55, 0.8, 0.97):
        for g in (1, 3.5, 8):
            assert plan.acceptance_from_steps(plan.expected_tokens_fractional(a, g), g) == pytest.approx(a, abs=1e-6)


def test_best_length_follows_acceptance_and_costs():
    _, best = plan.plan_table(0.0, 0.1, CURVE, 8)
    assert best == 0  # nothing is ever accepted: drafting only costs
    _, best = plan.plan_table(0.99, 0.0, plan.CostCurve(((1, 1.0),)), 8)
    assert best == 8  # free drafts, flat verification: draft as far as allowed
    rows, best = plan.plan_table(0.7, 0.09, CURVE, 8)
    assert 3 <= best <= 6 and plan.speedup(rows[best], CURVE) > 1.3
    mixed = plan.predict_mix(0.7, 0.09, CURVE, 4, 1.0)
    assert mixed.tokens_per_second == pytest.approx(rows[4].tokens_per_second)
    assert plan.predict_mix(0.7, 0.09, CURVE, 4, 0.0).tokens_per_second == pytest.approx(1 / CURVE(1))
    with pytest.raises(ValueError, match="acceptance"):
        plan.plan_table(1.5, 0.1, CURVE, 4)


def test_round_trips_cost_every_step_but_drafting_ones_cost_two():
    far = plan.predict(0.7, 0.09, CURVE, 4, rtt=0.01, hops=2)
    near = plan.predict(0.7, 0.09, CURVE, 4)
    assert far.step_seconds == pytest.approx(near.step_seconds + 0.02)
    assert plan.predict(0.7, 0.09, CURVE, 0, rtt=0.01, hops=2).step_seconds == pytest.approx(CURVE(1) + 0.01)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec_tools.cli", "plan", *args], capture_output=True, text=True, timeout=60)


def test_plan_command_names_the_best_length_and_rejects_bad_input():
    done = run_cli("--acceptance", "0.7", "--draft-cost", "0.09", "--cost-curve", "1:44,2:70,4:67,8:70,16:85", "--max-draft", "8")
    assert done.returncode == 0, done.stderr
    assert "<- best" in done.stdout and "best draft length: 5" in done.stdout
    bad = run_cli("--acceptance", "2", "--cost-curve", "1:44")
    assert bad.returncode == 2 and "acceptance must be in [0, 1]" in bad.stderr
    neither = run_cli("--acceptance", "0.5")
    assert neither.returncode == 2 and "exactly one of --cost-curve and --measure" in neither.stderr


def test_overlap_prediction_hides_drafting_only_when_bets_win():
    # Every bet wins: a step costs the longer of the Verify and the run-ahead beside it.
    sure = plan.predict_overlap(1.0, 4, draft_token_s=0.01, verify_s=0.1, wire_s=0.002)
    assert sure.hit_rate == 1.0
    assert sure.sequential_step == pytest.approx(4 * 0.01 + 0.1 + 0.002)
    assert sure.overlapped_step == pytest.approx(0.1 + 0.001)
    assert sure.speedup == pytest.approx(0.142 / 0.101)
    # A draft slower than the Verify is the bottleneck of a ready step.
    slow = plan.predict_overlap(1.0, 4, draft_token_s=0.05, verify_s=0.1)
    assert slow.overlapped_step == pytest.approx(5 * 0.05)
    # No bet ever wins: each step also waits for the cancelled run-ahead, so it is slower.
    never = plan.predict_overlap(0.0, 4, draft_token_s=0.01, verify_s=0.1)
    assert never.hit_rate == 0.0 and never.speedup < 1.0
    # Between, h = a^(g+1).
    assert plan.predict_overlap(0.5, 3, 0.01, 0.1).hit_rate == pytest.approx(0.5 ** 4)


def test_draft_costs_fit_catch_up_and_per_token():
    # 30 ms to catch up, then 70 ms per token, measured at three lengths.
    catch_up, per_token = plan.fit_draft_costs([(1, 0.1), (2, 0.17), (4, 0.31)])
    assert catch_up == pytest.approx(0.03) and per_token == pytest.approx(0.07)
    assert plan.fit_draft_costs([(4, 0.2)]) == (0.0, 0.05)  # one length: all per token
    assert plan.fit_draft_costs([]) == (0.0, 0.0)
    # The catch-up is what a run-ahead saves besides hidden drafting (it continues its own chain).
    with_catch_up = plan.predict_overlap(1.0, 1, 0.07, 0.12, catch_up_s=0.03)
    assert with_catch_up.sequential_step == pytest.approx(0.03 + 0.07 + 0.12)
    assert with_catch_up.overlapped_step == pytest.approx(max(0.12, 2 * 0.07))
