"""Overlapped speculation (coordinator/policy/overlap.py): the draft drafts step t+1 while the target
verifies step t. It may only ever change speed: greedy output stays the target's own, sampling
stays exactly the target's distribution, and a draft that fails while running ahead costs nothing
but the run-ahead.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.maths.costs import MODEL_DRAFT_PRIOR, CostModel
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import GenerationSpec, Stats
from coordinator.policy.overlap import PROBE_EVERY, RunAheadPolicy
from draft_service.drafters.model import ModelDrafter
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig, target_probs
from target_service.engine import TargetEngine
from tests import tiny
from tests.services import Service
from tests.stack import Stack
from tests.test_faults import CONCURRENT, TARGET_DRAFT_TOKENS, counted, run_concurrently
from tests.test_faults import MAX_NEW as FAULTS_MAX_NEW
from tests.test_sampling_engines import FALSE_ALARM, chi_square_pvalue
from tests.test_sampling_engines import tiny as tiny12

MAX_NEW = 24
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair():
    return tiny.tiny_pair(seed=0)


def loop_over(target_model, draft_model, overlap="on", proposer_cls=LocalProposer, top_k=32):
    target = TargetEngine(CausalLM(target_model, CPU))
    draft = DraftEngine(ModelDrafter(CausalLM(draft_model, CPU), top_k=top_k))
    loop = SpeculativeLoop(LocalVerifier(target), proposer_cls(draft), CostModel(MODEL_DRAFT_PRIOR), MODEL_DRAFT_PRIOR, overlap)
    return loop, target, draft


async def generate(loop, prompt, max_new=MAX_NEW, draft_length=4, adaptive=False, sampling=None, seeded=False):
    spec = GenerationSpec(request_id="r", prompt_ids=list(prompt), max_new_tokens=max_new, sampling=sampling or SamplingConfig(),
                          draft_length=draft_length, adaptive=adaptive, eos_token_ids=frozenset({tiny.EOS}), seeded=seeded)
    stats = Stats()
    out: list[int] = []
    async for step in loop.run(spec, stats):
        out.extend(step.tokens)
    return out, stats


@pytest.mark.parametrize("draft_length", [1, 2, 4, 7])
def test_greedy_with_overlap_is_the_target_alone(pair, draft_length):
    """A perfect draft (the target itself: every bet wins) and a noisy one (bets lost mid-run)."""
    target_model, draft_model = pair
    for drafter, must_hit in ((target_model, True), (draft_model, False)):
        loop, target, draft = loop_over(target_model, drafter)
        totals = Stats()
        for prompt in tiny.prompts(8, seed=draft_length):
            tokens, stats = asyncio.run(generate(loop, prompt, draft_length=draft_length))
            assert tokens == tiny.reference_greedy(target_model, prompt, MAX_NEW)
            for field in ("runahead_steps", "runahead_hits", "runahead_tokens", "runahead_used_tokens"):
                setattr(totals, field, getattr(totals, field) + getattr(stats, field))
        assert totals.runahead_steps > 0
        assert totals.runahead_used_tokens <= totals.runahead_tokens
        if must_hit:
            assert totals.runahead_hits > 0.5 * totals.runahead_steps
        else:
            assert totals.runahead_hits < totals.runahead_steps  # misses happened and were recovered from
        assert len(target.store) == 0 and len(draft.store) == 0


def test_a_wrong_bonus_guess_after_full_acceptance_is_a_miss(pair):
    """The target accepts the whole draft but adds another token than the draft guessed: the
    run-ahead must be dropped even though every draft token was right."""
    target_model, draft_model = pair

    class WrongGuess(LocalProposer):
        async def propose(self, *args, progress=None, **kwargs):
            outcome = await super().propose(*args, progress=None, **kwargs)
            if progress is not None and outcome.tokens:  # a run-ahead: make its guess wrong
                self.engine.store.release(args[0].sequence_id, retire=False)  # and its state unusable
                bad = (outcome.tokens[0] + 1) % tiny.VOCAB
                progress.arrived(bad)
                return type(outcome)([bad, *outcome.tokens[1:]], outcome.dists, outcome.compute_seconds, outcome.wall_seconds)
            return outcome

    loop, _, _ = loop_over(target_model, target_model, proposer_cls=WrongGuess)
    for prompt in tiny.prompts(4, seed=3):
        tokens, stats = asyncio.run(generate(loop, prompt))
        assert tokens == tiny.reference_greedy(target_model, prompt, MAX_NEW)
        assert stats.runahead_steps > 0 and stats.runahead_hits == 0


def test_a_draft_dying_while_running_ahead_costs_only_speed(pair):
    target_model, draft_model = pair

    class DiesAhead(LocalProposer):
        calls = 0

        async def propose(self, *args, progress=None, **kwargs):
            self.calls += 1
            if progress is not None and self.calls % 2:
                if self.calls % 4 == 1:
                    progress.arrived(0)  # dies after streaming its guess
                await asyncio.sleep(0)
                raise ConnectionError("draft died while running ahead")
            return await super().propose(*args, progress=progress, **kwargs)

    loop, target, draft = loop_over(target_model, target_model, proposer_cls=DiesAhead)
    for prompt in tiny.prompts(6, seed=4):
        tokens, stats = asyncio.run(generate(loop, prompt))
        assert tokens == tiny.reference_greedy(target_model, prompt, MAX_NEW)
        assert stats.runahead_steps > 0
    assert len(target.store) == 0 and len(draft.store) == 0


@pytest.mark.slow  # test-all: the suite's time (issue 58); test_distribution's overlap and lost-bet cases check the pipelined path's sampling
def test_sampling_with_overlap_is_exactly_the_target_distribution():
    """The third token is the first one a used run-ahead can decide (draft length 1: the step's
    draft, the bonus guess, then the run-ahead's draft token). Its distribution given the first two
    must be the target's, over all runs and over the runs whose run-ahead was used alone."""
    target_model = tiny12(0)
    # The draft: the target itself, truncated to its top 6 tokens (so p != q and rejections happen)
    # - close enough that the target's bonus token is often the one guessed and run-aheads get used.
    loop, _, _ = loop_over(target_model, target_model, top_k=6)
    base = dict(temperature=0.9, top_k=8, top_p=0.9)
    prompt = [3, 1, 4]

    async def all_runs():
        runs = []
        for seed in range(3_000):
            tokens, stats = await generate(loop, prompt, max_new=4, draft_length=1, sampling=SamplingConfig(seed=seed, **base))
            runs.append((tokens, stats.runahead_hits > 0))
        return runs

    runs = [(t, hit) for t, hit in asyncio.run(all_runs()) if len(t) >= 3]
    pairs = [tuple(t[:2]) for t, _ in runs]
    top = max(set(pairs), key=pairs.count)
    with torch.inference_mode():
        q2 = target_probs(target_model(torch.tensor([prompt + list(top)])).logits[0, -1], SamplingConfig(**base))
    third = [t[2] for t, _ in runs if tuple(t[:2]) == top]
    third_hit = [t[2] for t, hit in runs if tuple(t[:2]) == top and hit]
    assert len(third_hit) > 150, f"too few used run-aheads to test ({len(third_hit)} of {len(third)})"
    assert chi_square_pvalue(third, q2) > FALSE_ALARM
    assert chi_square_pvalue(third_hit, q2) > FALSE_ALARM


def test_seeded_sampling_does_not_run_ahead(pair):
    """A client-chosen seed must replay exactly, so its draws never depend on the schedule."""
    target_model, draft_model = pair
    loop, _, _ = loop_over(target_model, draft_model)
    sampling = SamplingConfig(temperature=0.8, seed=7)
    first, stats = asyncio.run(generate(loop, tiny.prompts(1)[0], sampling=sampling, seeded=True))
    again, _ = asyncio.run(generate(loop, tiny.prompts(1)[0], sampling=sampling, seeded=True))
    assert first == again and stats.runahead_steps == 0


def decisions(policy: RunAheadPolicy) -> list[bool]:
    """What the policy decides over PROBE_EVERY consecutive steps, as it stands."""
    out = []
    for step in range(40, 40 + PROBE_EVERY):
        policy.steps = step
        out.append(policy.should_run_ahead())
    return out


def test_auto_policy_runs_ahead_only_while_it_pays():
    policy = RunAheadPolicy("auto")
    assert policy.should_run_ahead()  # nothing measured yet: try
    for _ in range(20):  # every bet lost, slow to stop: not worth it
        policy.observe(4, 1, True, False, verify_wall=0.1, draft_wall=0.05, miss_wait=0.02)
    assert decisions(policy).count(True) == 1  # only the probe of the other schedule
    winning = RunAheadPolicy("auto")
    for _ in range(20):  # every bet won, hiding 50 ms each
        winning.observe(4, 4, True, True, verify_wall=0.1, draft_wall=0.05, miss_wait=0.005)
    assert decisions(winning).count(True) == PROBE_EVERY - 1
    shared = RunAheadPolicy("auto")  # bets won, but the Verify beside a run-ahead is much slower
    for ran_ahead in [True, False] * 10:
        shared.observe(4, 4, ran_ahead, ran_ahead, verify_wall=0.2 if ran_ahead else 0.1, draft_wall=0.05, miss_wait=0.005)
    assert decisions(shared).count(True) == 1
    assert RunAheadPolicy("on").should_run_ahead() and not RunAheadPolicy("off").should_run_ahead()
    with pytest.raises(ValueError, match="overlap mode"):
        RunAheadPolicy("sometimes")


@pytest.fixture(scope="module")
def grpc_env(pair, tmp_path_factory):
    target_model, draft_model = pair
    folder = tmp_path_factory.mktemp("overlap")
    target_path = tiny.save(target_model, folder / "target")
    draft_path = tiny.save(draft_model, folder / "draft")
    stack = Stack()
    target = stack.target(target_path)
    clients = {}
    for name, model in (("self", target_path), ("noisy", draft_path)):
        draft = stack.draft(drafter="model", model=model)
        clients[name] = stack.client(stack.coordinator(target, draft, tiny.byte_tokenizer(), overlap="on"))
    yield clients, stack
    stack.stop()


def test_greedy_through_grpc_with_overlap(pair, grpc_env):
    target_model, _ = pair
    clients, stack = grpc_env
    for name, client in clients.items():
        steps = hits = 0
        for prompt in tiny.prompts(10, seed=11):
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=MAX_NEW,
                                         speculation=pb.SpeculationParams(draft_length=3, adaptive=False))
            response = client.Generate(request, timeout=60)
            assert list(response.token_ids) == tiny.reference_greedy(target_model, prompt, MAX_NEW), name
            steps += response.stats.runahead_steps
            hits += response.stats.runahead_hits
            assert response.stats.runahead_used_tokens <= response.stats.runahead_tokens
        assert steps > 0, name
        if name == "self":
            assert hits > 0.5 * steps
        else:
            assert hits < steps
    for server in stack.servers:  # every sequence freed in both services, cancelled run-aheads included
        engine = getattr(getattr(server, "servicer", None), "engine", None)
        if engine is not None:
            assert len(engine.store) == 0


def test_draft_killed_while_running_ahead_all_complete_identical(pair, tmp_path):
    """The draft process dies with run-aheads in flight (a perfect draft: nearly every step runs
    ahead): every request completes, token-identical to the target alone."""
    target_model, _ = pair
    target_path = tiny.save(target_model, tmp_path / "target")
    draft = Service("draft", "--drafter", "model", "--model", target_path, "--device", "cpu", "--metrics-port", "-1").start()
    stack = Stack()
    try:
        coordinator = stack.coordinator(stack.target(target_path), draft.address, tiny.byte_tokenizer(), rpc_timeout_s=5, overlap="on")
        stub = stack.client(coordinator)
        prompts = tiny.prompts(CONCURRENT, seed=5)
        verified = counted(TARGET_DRAFT_TOKENS)  # killed once the target verifies drafts: run-aheads are in flight
        outcomes = run_concurrently(stub, prompts, timeout=120, during=draft.kill, once=lambda: counted(TARGET_DRAFT_TOKENS) > verified)
        assert [kind for kind, _ in outcomes] == ["ok"] * CONCURRENT
        for (_, response), prompt in zip(outcomes, prompts):
            assert list(response.token_ids) == tiny.reference_greedy(target_model, prompt, FAULTS_MAX_NEW)
        assert sum(r.stats.runahead_steps for _, r in outcomes) > 0
    finally:
        draft.stop()
        stack.stop()


@pytest.mark.slow
def test_overlap_bench_quick(tmp_path):
    """`specdec bench --overlap --quick`: both schedules, pinned apart, every run identical."""
    import json
    import subprocess
    import sys

    out = tmp_path / "overlap"
    done = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "bench", "--overlap", "--quick", "--draft-lengths", "1,2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sequential vs overlapped" in done.stdout
    document = json.loads((out / "overlap.json").read_text())
    assert [r["draft_length"] for r in document["rows"]] == [1, 2]
    for row in document["rows"]:
        for schedule in ("sequential", "overlapped"):
            ident = row[schedule]["identical"]
            assert ident["identical"] == ident["runs"] > 0
        assert row["overlapped"]["runahead_steps"] > 0 and row["sequential"]["runahead_steps"] == 0
        assert row["overlapped_vs_sequential"] > 0 and row["predicted_overlapped_vs_sequential"] > 0
