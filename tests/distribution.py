"""Sampling is lossless under the settings users get: the joint distribution of the first three
tokens the real loop emits equals the target's exact distribution.

Every case drives `SpeculativeLoop` as a coordinator with default flags builds it
(`coordinator.servicer.make_loop`: adaptive draft length with its cumulative-probability threshold,
costs learned across requests, decode-ahead on, the load cap), with unseeded requests, a draft that
differs from the target (acceptance well below 1), and compares the emitted tokens with the
target's exact distribution, enumerated by brute force over a tiny vocabulary (`exact_joint`).

The cost model learns from the seconds each pass reports, and in process those are fixed
(`FIXED_COSTS`, coordinator/local.py's `fixed_costs`) at costs where drafting pays: the learning
code runs, but how much is drafted no longer follows the machine's speed or load. On measured
timings the 16-wide models sit at break-even, and a busy CI machine once drafted 18 tokens in
1,000 requests. One case on measured timings (`slow`) keeps the learned path end to end. Through
the gRPC services (three servers, measured timings) the requests fix their draft length; the
adaptive ones there are `slow` too.

The check is a chi-square test over the cells (token triples; a sequence that ends at EOS earlier
is a cell of its own), pooling cells expected fewer than 5 times, at a false-alarm rate of 1e-4
per case. Each case prints its sample count and the smallest bias it detects with power 0.9: the
mass moved from the likeliest cell to the next that the test would catch 9 times in 10
(`detectable_shift`); each asserts that bias is small. A case is sized by that bias, not by a count:
it takes the fewest requests whose check detects a shift of SIZED_SHIFT (`samples_for`), so a
case whose target spreads its mass over few cells needs fewer requests than one over many. The power is shown, not only computed: the
same check applied to two wrong rules (a verifier that accepts every draft token; a drafter that
cuts a drawn token by its own probability, the bias this suite was written to catch) fails.

SPECDEC_DISTRIBUTION_SHIFT sets the shift every case is sized to detect (default 0.075), and
SPECDEC_DISTRIBUTION_SAMPLES the most requests a case takes (default 1,000; 5/6 of it through gRPC).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import random

import torch
from scipy import optimize, stats
from transformers import LlamaConfig, LlamaForCausalLM

from coordinator.config import CoordinatorConfig
from coordinator.local import LocalProposer, LocalVerifier
from coordinator.loop import SpeculativeLoop
from coordinator.protocol import GenerationSpec, Stats
from coordinator.policy.admission import Admission
from coordinator.servicer import make_loop
from specdec.maths.costs import Costs, cost_curve
from draft_service.engine import DraftEngine
from protos import specdec_pb2 as pb
from specdec.model.lm import CausalLM
from specdec.maths.sampling import SamplingConfig, target_probs
from target_service.engine import TargetEngine


SAMPLES = int(os.environ.get("SPECDEC_DISTRIBUTION_SAMPLES", "1000"))  # the most requests a case takes
SIZED_SHIFT = float(os.environ.get("SPECDEC_DISTRIBUTION_SHIFT", "0.075"))  # what each case is sized to detect
FALSE_ALARM = 1e-4  # per case
BASELINE_REQUESTS = 200  # requests of a case that only counts (what is drafted without a prediction)
POWER = 0.9
MAX_DETECTABLE = 0.08  # every case must catch a shift of this much probability mass (see detectable_shift)
DEPTH = 3  # tokens whose joint distribution is checked
CPU = torch.device("cpu")
DEFAULTS = CoordinatorConfig()
# What every in-process pass reports it cost: a target forward 20 ms, over n new positions
# 20 ms * (1.1 + 0.05 (n - 2)) for n >= 2 (the 1 -> 2 jump of a CPU, a small one), a draft token
# 2 ms, each exchange 0.5 ms. Drafting one token then pays from an acceptance of ~0.22.
FIXED_COSTS = Costs(draft_per_token=0.002, verify=cost_curve(0.02, 1.1, 0.001), wire_per_step=0.0005, draft_per_ask=0.0005)


# -- the models ---------------------------------------------------------------------------------------

V = 12  # small enough to enumerate every three-token continuation (12^3 cells)


def small_config(layers: int, vocab: int = V) -> LlamaConfig:
    """Token V - 1 is the end of sequence; with another vocabulary size, nothing is."""
    eos = V - 1 if vocab == V else None
    return LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
                       num_key_value_heads=1, initializer_range=0.5, eos_token_id=eos, bos_token_id=0, pad_token_id=eos)


def with_damped_layers(base: LlamaForCausalLM, extra: int = 2, damping: float = 0.3, seed: int = 0) -> LlamaForCausalLM:
    """`base` with `extra` random layers after its own, damped so they only nudge its distribution.

    A target built so from a draft's own layers (plus noise) agrees with that draft often but not
    always, and costs several draft forwards: the learned costs then make drafting pay, as with a
    real draft, and the default adaptive policy drafts."""
    config = base.config.__class__(**{**base.config.to_dict(), "num_hidden_layers": base.config.num_hidden_layers + extra})
    torch.manual_seed(seed)
    deep = LlamaForCausalLM(config).eval()
    deep.load_state_dict(base.state_dict(), strict=False)  # embeddings, the base's layers, norm, head
    with torch.no_grad():
        for layer in deep.model.layers[base.config.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.mul_(damping)
            layer.mlp.down_proj.weight.mul_(damping)
    deep.generation_config.eos_token_id = deep.generation_config.pad_token_id = config.eos_token_id
    return deep


def noisy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std().clamp(min=1e-3))
    return copy


def small_pair(seed: int = 0) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(target, draft) over 12 tokens: a one-layer draft, and a target of its layer and six damped ones."""
    torch.manual_seed(seed)
    base = LlamaForCausalLM(small_config(1)).eval()
    return with_damped_layers(base, extra=6, seed=seed), noisy(base, 0.1, seed + 1)


def pair_models() -> dict[str, LlamaForCausalLM]:
    """small_pair() as the cases take it; each test file makes it a module-scoped fixture `models`."""
    target, draft = small_pair()
    return {"target": target, "draft": draft}


# -- the exact distribution and the test --------------------------------------------------------------

Cell = tuple[int, ...]


@torch.inference_mode()
def exact_joint(model, prompt: list[int], sampling: SamplingConfig, eos: set[int], depth: int = DEPTH,
                floor: float = 1e-5) -> dict[Cell, float]:
    """P(first `depth` tokens) under plain sampling from `model`: every continuation enumerated, a
    sequence ending at EOS is its own cell, and continuations of prefixes rarer than `floor` are
    pooled into the cell () with their exact total mass (so the cells always sum to 1)."""
    cells: dict[Cell, float] = {}
    frontier: list[tuple[Cell, float]] = [((), 1.0)]
    for level in range(depth):
        if not frontier:
            break
        ids = torch.tensor([prompt + list(prefix) for prefix, _ in frontier])
        q = target_probs(model(ids).logits[:, -1], sampling).double()  # [N, V]
        grown = []
        for (prefix, mass), row in zip(frontier, q):
            for token in torch.nonzero(row).flatten().tolist():
                cell, p = prefix + (token,), mass * float(row[token])
                if token in eos or level == depth - 1:
                    cells[cell] = p
                elif p >= floor:
                    grown.append((cell, p))
                else:
                    cells[()] = cells.get((), 0.0) + p
        frontier = grown
    return cells


def cell_of(tokens: list[int], eos: set[int], depth: int = DEPTH) -> Cell:
    out = []
    for token in tokens[:depth]:
        out.append(token)
        if token in eos:
            break
    return tuple(out)


def pooled(exact: dict[Cell, float], counts: collections.Counter, n: int) -> tuple[list[float], list[int]]:
    """(probabilities, counts) with every cell expected < 5 times pooled into one."""
    probs, observed, rest_p, rest_n = [], [], 0.0, 0
    unknown = sum(c for cell, c in counts.items() if cell not in exact)
    for cell, p in exact.items():
        if p * n >= 5 and cell != ():
            probs.append(p)
            observed.append(counts.get(cell, 0))
        else:
            rest_p += p
            rest_n += counts.get(cell, 0)
    if rest_p > 0:
        probs.append(rest_p)
        observed.append(rest_n + unknown)
    elif unknown:
        raise AssertionError(f"{unknown} samples fell in cells the target gives probability 0")
    return probs, observed


def detectable_shift(probs: list[float], n: int, alpha: float = FALSE_ALARM, power: float = POWER) -> float:
    """Smallest probability mass moved from the likeliest cell to the second that this test detects
    with the given power (noncentral chi-square: lambda = n * d^2 * (1/p1 + 1/p2))."""
    df = len(probs) - 1
    critical = stats.chi2.isf(alpha, df)
    lam = optimize.brentq(lambda x: stats.ncx2.sf(critical, df, x) - power, 1e-6, 1e6)
    p1, p2 = sorted(probs, reverse=True)[:2]
    return (lam / (n * (1 / p1 + 1 / p2))) ** 0.5


def chi_square(samples: list[Cell], exact: dict[Cell, float]) -> tuple[float, float]:
    """(p-value, detectable shift) of the samples against the exact distribution."""
    n = len(samples)
    probs, observed = pooled(exact, collections.Counter(samples), n)
    assert len(probs) >= 3, "too few cells for a meaningful test"
    expected = [p / sum(probs) * n for p in probs]  # sums to n exactly (the cells' float sum is 1 to ~1e-9)
    return float(stats.chisquare(observed, expected).pvalue), detectable_shift(probs, n)


def samples_for(exact: dict[Cell, float], shift: float = SIZED_SHIFT, most: int = SAMPLES) -> int:
    """The fewest requests (at most `most`) whose check detects `shift` with power POWER. The
    detectable shift depends only on the exact distribution and the count (the pooling too), so the
    size is known before sampling."""
    def detects(n: int) -> bool:
        return detectable_shift(pooled(exact, collections.Counter(), n)[0], n) <= shift

    if not detects(most):
        return most
    low, high = 1, most  # detects(high) holds
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if detects(middle) else (middle, high)
    return high


def assert_target_distribution(name: str, samples: list[Cell], exact: dict[Cell, float], stats_: Stats | None = None):
    pvalue, shift = chi_square(samples, exact)
    extra = ""
    if stats_ is not None:
        extra = f", {stats_.accepted_tokens}/{stats_.draft_tokens} draft tokens accepted"
    print(f"{name}: {len(samples)} samples, p = {pvalue:.3g}, detects a shift of {shift:.3f}{extra}")
    assert shift <= MAX_DETECTABLE, f"{name}: too few samples to detect a {MAX_DETECTABLE} bias ({shift:.3f})"
    assert pvalue > FALSE_ALARM, f"{name}: emitted tokens do not follow the target's distribution (p = {pvalue:.3g})"


# -- driving the loop ---------------------------------------------------------------------------------

def default_loop(verifier, proposer, drafter: str = "model", needs_features: bool = False, **config) -> SpeculativeLoop:
    """The loop a coordinator builds with default flags (plus `config`), over in-process engines."""
    coordinator = dataclasses.replace(DEFAULTS, **config)
    admission = Admission(coordinator.max_concurrent_requests, coordinator.max_queue, coordinator.verify_token_budget)
    return make_loop(coordinator, verifier, proposer, pb.ModelInfo(drafter=drafter, needs_features=needs_features),
                     admission.draft_cap)


def spec_for(prompt: list[int], sampling: SamplingConfig, eos: set[int], max_new: int = DEPTH, **overrides) -> GenerationSpec:
    """An unseeded request as the coordinator makes it from default flags."""
    fields = dict(request_id="dist", prompt_ids=list(prompt), max_new_tokens=max_new, sampling=sampling,
                  draft_length=DEFAULTS.draft_length, adaptive=DEFAULTS.adaptive, eos_token_ids=frozenset(eos), seeded=False)
    return GenerationSpec(**{**fields, **overrides})


def sample_loop(loop: SpeculativeLoop, prompt: list[int], sampling: SamplingConfig, eos: set[int], n: int = SAMPLES,
                **spec) -> tuple[list[Cell], Stats]:
    """n requests (each with its own random seed, as unseeded requests get), their first tokens."""
    rng = random.Random(1234)
    total = Stats()

    async def run_all():
        samples = []
        for _ in range(n):
            request = spec_for(prompt, dataclasses.replace(sampling, seed=rng.getrandbits(63)), eos, **spec)
            stats_, out = Stats(), []
            async for step in loop.run(request, stats_):
                out += step.tokens
            total.draft_tokens += stats_.draft_tokens
            total.accepted_tokens += stats_.accepted_tokens
            samples.append(cell_of(out, eos))
        return samples

    return asyncio.run(run_all()), total


def eos_of(model) -> set[int]:
    return set(CausalLM(model, CPU).eos_token_ids)


PROMPT = [3, 1, 4, 1, 5]
PLAIN = SamplingConfig(temperature=1.0)


def check_case(name, models, drafter, sampling=PLAIN, prompt=PROMPT, loop_kwargs=None, n: int | None = None,
               target_engine=TargetEngine, acceptance=(0.1, 0.9), min_drafted=0.3, costs: Costs | None = FIXED_COSTS,
               verifier_type=LocalVerifier, **spec) -> int:
    """Runs the case (n requests; by default as many as `samples_for` says) and asserts the target's
    distribution; returns n. The case must test speculation, not the target alone: it drafts at
    least `min_drafted` tokens per request on average, and accepts a share of them inside
    `acceptance`. `costs`: what each pass reports it cost (None: measured)."""
    target = models["target"]
    verifier = verifier_type(target_engine(CausalLM(target, CPU)), fixed_costs=costs)
    proposer = LocalProposer(DraftEngine(drafter), fixed_costs=costs)
    loop = default_loop(verifier, proposer, **(loop_kwargs or {}))
    eos = eos_of(target)
    exact = exact_joint(target, prompt, sampling, eos)
    n = n or samples_for(exact)
    samples, total = sample_loop(loop, prompt, sampling, eos, n=n, **spec)
    low, high = acceptance
    assert total.draft_tokens > min_drafted * n and low * total.draft_tokens <= total.accepted_tokens <= high * total.draft_tokens, \
        f"{name}: {total.accepted_tokens} of {total.draft_tokens} draft tokens accepted"
    assert_target_distribution(name, samples, exact, total)
    return n



class LookupCounting(LocalVerifier):
    """Counts the tokens the target drafted for itself by prompt lookup."""

    drafted = accepted = 0

    async def verify(self, call):
        out = await super().verify(call)
        LookupCounting.drafted += out.ahead_drafted
        LookupCounting.accepted += out.ahead_accepted
        return out

