"""Sampling is lossless under the settings users get: the sampling settings, the model chain, trees,
n-gram drafts, pipelining and compact targets, in process (tests/distribution.py holds the method:
the exact distribution, the chi-square check and its power), and the check's own power against
two wrong rules.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_service.drafters.base import Proposal
from specdec.calls.request import ProposeCall, TreeSettings
from draft_service.drafters.model import ChainState, ModelDrafter
from draft_service.drafters.ngram import NgramDrafter
from draft_service.drafters.feature import FeatureDrafter
from specdec.model.cpu import gemm
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig, target_probs, truncated_probs
from target_service.engine import TargetEngine
from specdec.maths.verify import verify_rejection
from tests import tiny
from tests.distribution import (
    pair_models,
    CPU,
    DEFAULTS,
    DEPTH,
    check_case,
    small_config,
    with_damped_layers,
)

pytestmark = [pytest.mark.distribution, pytest.mark.usefixtures("one_torch_thread")]

models = pytest.fixture(scope="module", name="models")(pair_models)


# -- the cases ----------------------------------------------------------------------------------------

def test_model_chain_draft(models):
    check_case("model chain", models, ModelDrafter(CausalLM(models["draft"], CPU)))


@pytest.mark.slow
def test_model_chain_draft_measured_costs(models):
    """The learned path end to end: costs learned from the seconds each pass took. How much is
    drafted then follows the machine (these 16-wide models sit near break-even), so it only runs
    with `make test-all`."""
    check_case("model chain, measured costs", models, ModelDrafter(CausalLM(models["draft"], CPU)), costs=None, min_drafted=0.05)


@pytest.mark.parametrize("weights", [pytest.param("q4", marks=pytest.mark.slow), "q4-a8"])  # q4 in test-all: the suite's time
def test_compact_weights_target(models, weights):
    """--weights q4 (q4-a8: with activations rounded to 8 bits and row-exact attention): the served
    target is that model, and speculation samples from its distribution."""
    target = copy.deepcopy(models["target"])
    gemm.pack_linears(target, gemm.DEFAULT_ROWS, 1, weights)
    check_case(f"{weights} target", {"target": target, "draft": models["draft"]}, ModelDrafter(CausalLM(models["draft"], CPU)))


def test_sparse_top_k_draft(models):
    """The draft draws from its top-3 only: p is 0 elsewhere, and the wire carries 3 entries."""
    check_case("draft top-3", models, ModelDrafter(CausalLM(models["draft"], CPU), top_k=3))


def test_temperature_and_top_k(models):
    check_case("T=0.7, top-k 5", models, ModelDrafter(CausalLM(models["draft"], CPU)),
               sampling=SamplingConfig(temperature=0.7, top_k=5))


def test_top_p(models):
    check_case("T=1.3, top-p 0.8", models, ModelDrafter(CausalLM(models["draft"], CPU)),
               sampling=SamplingConfig(temperature=1.3, top_p=0.8))


@pytest.mark.parametrize("shape", [(), pytest.param((2, 2, 1), marks=pytest.mark.slow)], ids=["dynamic", "static"])  # static in test-all
def test_tree_draft(models, shape):
    tree = TreeSettings(budget=8, top_k=DEFAULTS.tree_top_k, shape=shape)
    check_case(f"tree {shape or 'dynamic'}", models, ModelDrafter(CausalLM(models["draft"], CPU)), tree=tree)


def test_ngram_draft(models):
    """Prompt lookup: one-hot p, and the coordinator cuts each proposal by its calibrated confidence.
    The prompt repeats a pattern this target continues about half the time (1 after it ~93%, then
    0 less often), so about half the drafted tokens are accepted. How many are drafted follows the
    learned costs (the cut weighs each token's confidence against a longer target forward): on
    measured timings 0.2 to 2 tokens a request were seen, with the fixed ones it is the same everywhere."""
    check_case("n-gram", models, NgramDrafter(4, 1), prompt=[1, 0, 4, 1, 0, 4], loop_kwargs={"drafter": "ngram"})


def test_overlap_on(models):
    """The draft runs ahead during Verify and bets on the bonus token. One draft token per step puts
    the bet, and a fresh draft after a lost bet, inside the first three tokens."""
    check_case("overlap on", models, ModelDrafter(CausalLM(models["draft"], CPU)), loop_kwargs={"overlap": "on"},
               max_new=DEPTH + 1, draft_length=1)



@pytest.mark.slow
def test_feature_tree_draft():
    """test_feature_draft's case drafting dynamic trees (draft_service/drafters/feature.py): siblings
    drawn without replacement from the feature draft's top 6, judged by recursive rejection sampling.
    Slow (as long as the chain's case); tests/test_feature_tree.py checks the first token's
    distribution through both engines in a fraction of that."""
    base = tiny.one_layer_target(seed=3)
    drafter = FeatureDrafter(tiny.feature_draft_of(base, noise=0.05), CPU, [tiny.EOS], top_k=6)
    prompt = tiny.prompts()[1][:8]
    tree = TreeSettings(budget=8, top_k=DEFAULTS.tree_top_k)
    check_case("feature tree", {"target": with_damped_layers(base, extra=8)}, drafter, sampling=SamplingConfig(temperature=0.8, top_k=6),
               prompt=prompt, loop_kwargs={"needs_features": True}, max_new=DEPTH + 1, tree=tree)


# -- the power: the same check fails wrong rules ---------------------------------------------------------

class AcceptEverything(TargetEngine):
    """A wrong verifier: keeps every draft token, then samples its own token after them."""

    def _verdict(self, call, logits, position):
        gamma = len(call.draft_tokens)
        if call.sampling.greedy or not gamma:
            return super()._verdict(call, logits, position)
        q = target_probs(logits[gamma], call.sampling)
        return gamma, int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(call.sampling.seed + position))), []


class CutByOwnProbability(ModelDrafter):
    """A wrong drafter: draws a token, then drops it when the running product of probabilities,
    its own included, falls under the threshold (the rule this suite was written to catch)."""

    def choose(self, logits: torch.Tensor, state: ChainState) -> Proposal | None:
        call = state.call
        if state.drafted >= call.draft_length:
            return None
        ids, probs = truncated_probs(logits, call.temperature, self.top_k)
        choice = int(torch.multinomial(probs, 1, generator=state.generator))
        state.cumulative *= float(probs[choice])
        if state.cumulative < call.min_cumulative_prob:
            return None
        state.drafted += 1
        return Proposal(int(ids[choice]), (ids.tolist(), probs.tolist()), state.cumulative, 0.0)


def test_the_check_fails_a_wrong_verifier(models):
    """The model chain case, with a target that keeps every draft token: the check must fail it."""
    with pytest.raises(AssertionError, match="do not follow the target's distribution"):
        check_case("wrong rule: accept everything", models, ModelDrafter(CausalLM(models["draft"], CPU)),
                   target_engine=AcceptEverything, acceptance=(1, 1))


# -- the two defects, hand-built with exact frequencies ---------------------------------------------------

@pytest.mark.parametrize("rule, expected", [(ModelDrafter, 0.5), (CutByOwnProbability, 0.55)], ids=["drafter", "wrong cut"])
def test_threshold_stop_keeps_the_drawn_token(rule, expected):
    """Draft q = (0.9, 0.1), target p = (0.5, 0.5), threshold 0.5, one token. Cutting the drawn token
    by its own probability emits token 0 with probability 0.9 * 5/9 + 0.1 * 0.5 = 0.55 (a cut token
    leaves the target to sample alone); the drafter keeps it, and emits 0 with probability 0.5."""
    torch.manual_seed(0)
    two = LlamaForCausalLM(LlamaConfig(vocab_size=2, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                       num_attention_heads=1, num_key_value_heads=1)).eval()
    drafter = rule(CausalLM(two, CPU))
    logits, q = torch.tensor([0.9, 0.1]).log(), torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])  # q: [1, G+1, V]
    n, zeros = 6_000, 0
    accept_u = torch.rand(n, 1, generator=torch.Generator().manual_seed(1))
    sample_u = torch.rand(n, generator=torch.Generator().manual_seed(2))
    for i in range(n):
        proposal = drafter.choose(logits, drafter.begin(ProposeCall("s", 0, [], 1, 0.5, 1.0, i), 0.0))
        if proposal is None:  # nothing to verify: the target samples alone
            zeros += int(sample_u[i] < 0.5)
            continue
        p = torch.zeros(1, 1, 2)
        ids, probs = proposal.dist
        p[0, 0, ids] = torch.tensor(probs)
        verdict = verify_rejection(q, torch.tensor([[proposal.token]]), p, torch.tensor([1]), accept_u[i:i + 1], sample_u[i:i + 1])
        zeros += int((proposal.token if verdict.accepted[0] else verdict.next_tokens[0]) == 0)
    # 6,000 draws: the standard error is 0.0065, so 0.025 is ~4 of them, and 0.5 vs 0.55 is ~8.
    assert abs(zeros / n - expected) < 0.025, f"token 0 came out {zeros / n:.3f} of the time, expected {expected}"


def test_a_lost_bet_does_not_reuse_the_run_ahead_draws():
    """Overlap on, three tokens, a draft with the target's exact distribution (the target's extra
    layers are zeroed): every draft token is accepted, so the run-ahead's bet on the bonus token is
    decided by the two draws alone, and lost often. A fresh draft at the same position that re-drew
    from the noise that lost the bet skewed the third token (the run-ahead shared the draft's seed
    stream): p = 2e-14 with 1,500 samples, p = 3e-21 with 1,000 on the fixed costs. On measured
    timings these 16-wide models sat at break-even and CI once drafted 18 tokens in 1,000 requests
    (256-wide ones drafted on any load, in 19 s to these models' 4); on the fixed costs every
    in-process case runs on, they draft on every machine."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(small_config(1, vocab=3)).eval()
    target = with_damped_layers(base, damping=0.0)
    check_case("lost bets", {"target": target}, ModelDrafter(CausalLM(base, CPU)), loop_kwargs={"overlap": "on"},
               acceptance=(1, 1), max_new=DEPTH + 2, draft_length=1, prompt=[0, 1, 2, 1])


