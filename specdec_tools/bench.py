"""`specdec bench`: end-to-end greedy tokens/s of specdec against its peers, side by side, in one run.

Configurations, all on the same prompts, models and machine (results and their history: docs/benchmarks.md):
  hf              the target alone with transformers' generate(): the baseline
  hf-assisted     transformers' assisted generation (assistant_model=, or prompt_lookup_num_tokens=)
  specdec-off     the target alone through specdec's own engine (speculation off)
  specdec-local   specdec's speculative loop in one process (no gRPC), adaptive and at fixed lengths
  specdec-grpc    the three gRPC services as separate processes on loopback
  tree            a model or feature draft's dynamic tree (EAGLE-2 style, --tree-budgets nodes, depth --max-draft)
                  verified in one target pass, in one process; tree-grpc[...]: the first budget over gRPC
  staged          the model draft at fixed lengths, itself speculated by an n-gram index (--staged)
`specdec bench --overlap` is a separate comparison: sequential against overlapped speculation with
the draft and the target pinned to separate cores (specdec_tools/bench_overlap.py); `specdec bench
--kernel` times each weight format's linear layers against the memory's bandwidth (bench_kernel.py).
With --weights (fp32, bf16, f16, int8, q4, gguf; several comma-separated) each format gets its own
specdec rows, checked against that format with speculation off and compared with fp32's tokens;
llama.cpp (plain and prompt lookup, on the target's GGUF file) joins where llama-cpp-python is installed.
After the main table, "chain vs tree vs staged" puts each model draft's best chain (the most tokens
per target pass of its fixed-length and adaptive chains) beside its trees and staged runs.
Repetitions are interleaved (rep 1 of every configuration, then rep 2, ...) so drift on a shared
machine hits every configuration alike. Every specdec configuration's tokens are checked against
specdec-off in the same format (the target engine decoding alone; its tokens agree with generate()'s,
shown beside, but its row-exact attention and, on a GPU, its fixed-shape passes compute other last
bits): greedy speculation that changes the output is a bug, and the report says so.

Beside each measurement sits the analytic model's prediction (specdec_tools.plan) from the run's own
acceptance, the draft's measured cost and the target's measured cost curve V(n), and the efficiency
measured / predicted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

import torch

from specdec.model.cpu import gemm
from specdec.model.formats import FORMATS
from specdec_tools import flags
from specdec_tools import plan as planlib
from specdec_tools.stacks import Stack, draft_config
from specdec_tools.bench_runners import Sample, grpc_runner, hf_runner, local_runner, machine, quick_models
from specdec_tools.workload import PROMPT_SETS, PROMPTS_DIR, load_prompts, prompt_path


@dataclasses.dataclass(frozen=True)
class Options:
    target: str
    drafters: tuple[str, ...]  # "ngram", or a draft model spec (alias / folder / hub id)
    prompt_sets: tuple[str, ...]
    limit: int
    max_new_tokens: int
    repeats: int
    max_draft: int
    draft_lengths: tuple[int, ...]
    grpc: bool
    hf: bool
    out: pathlib.Path
    quick: bool
    prompt_lookup: int
    tree_budgets: tuple[int, ...] = (16, 32)
    tree_top_k: int = 8
    staged: bool = True
    weights: tuple[str, ...] = ("fp32",)  # --weights formats of the target; the first one also serves the gRPC rows
    device: str = "cpu"  # every model and service of the run; on CUDA the target serves with --numerics exact
    per_kind: bool = False  # each kind of prompt in a set (its id before the last "-N") is a set of its own
    llamacpp: bool = True  # llama.cpp rows on the target's GGUF, where llama-cpp-python is installed


@dataclasses.dataclass
class Configuration:
    name: str
    kind: str  # hf | hf-assisted | specdec-off | specdec-local | specdec-grpc | tree | staged
    drafter: str | None = None
    draft_length: int = 0
    adaptive: bool = False
    hops: int = 0  # network round trips per step (the analytic model's RTT term)
    runner: object = None  # callable(prompt_ids) -> Sample
    note: str = ""
    weights: str = "fp32"  # what the target's kernel reads its weights as ("gguf:Q4_1" for llama.cpp's rows)


@dataclasses.dataclass
class Result:
    """One configuration on one prompt set: every repetition of every prompt."""

    config: Configuration
    prompt_set: str
    samples: list[list[Sample]] = dataclasses.field(default_factory=list)  # [rep][prompt]
    curves: list[planlib.CostCurve] = dataclasses.field(default_factory=list)  # V(n) right before and after each pass


# --- measurements the analytic model needs --------------------------------------------------------

@torch.inference_mode()
def measure_cost_curve(lm, context: list[int], ns: list[int], repeats: int = 5) -> planlib.CostCurve:
    """V(n): one target forward over n new positions after `context`, keeping n logits as
    verification does. Every n is timed once per round, rounds repeated, the median kept: on a
    shared machine drift then hits every n alike instead of bending the curve."""
    from specdec.kv.store import Sequence

    seq = Sequence("cost-curve", tokens=list(context))
    lm.forward(seq)  # the cache now holds the whole context
    filler = (list(context) * (max(ns) // len(context) + 1))[: max(ns)]
    times: dict[int, list[float]] = {n: [] for n in ns}
    for round_ in range(repeats + 1):
        for n in ns:
            seq.crop_cache(len(context) - 1)  # the last context token is pending again: 1 + (n - 1) positions
            start = time.perf_counter()
            lm.forward(seq, filler[: n - 1], keep=n)
            if round_:  # round 0 warms up
                times[n].append(time.perf_counter() - start)
    return planlib.CostCurve(tuple((n, statistics.median(times[n])) for n in ns))


def curve_context(items: list[tuple[str, list[int]]], max_new: int, room: int | None) -> list[int]:
    """The context a prompt set decodes at, on average: its median-length prompt plus half the new
    tokens (cycled from the prompt). V(n) grows with the context its attention reads (~6% between
    the chat prompts' 42 tokens and the grounded ones' 204 here), so each set gets its own curve."""
    prompt = sorted((ids for _, ids in items), key=len)[len(items) // 2]
    context = (list(prompt) * 2)[: len(prompt) + max_new // 2]
    return context[:room] if room else context


def measure_draft_cost(engine, context: list[int], tokens: int = 8, repeats: int = 5) -> float:
    """Seconds per drafted token with a warm cache (the draft's prefill is not a per-token cost)."""
    from specdec.model.features import FeatureRows
    from specdec.calls.request import ProposeCall

    times = []
    # A feature draft drafts nothing without the target's features; their values do not change the cost.
    features = (FeatureRows(0, torch.zeros(len(context) - 1, engine.drafter.feature_dim))
                if engine.drafter.needs_features else None)
    for rep in range(repeats + 1):
        sid = f"draft-cost-{rep}-{uuid.uuid4().hex[:6]}"
        list(engine.propose(ProposeCall(sid, 0, list(context), 1, features=features)))  # prefill
        start = time.perf_counter()
        made = list(engine.propose(ProposeCall(sid, len(context), [], tokens)))
        elapsed = time.perf_counter() - start
        engine.release(sid)
        if made:
            times.append(elapsed / len(made))
    return statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else 0.0)


def measure_rtt(address: str, repeats: int = 50) -> float:
    """Median round trip of a tiny unary call (GetInfo) on the draft/target channel."""
    import grpc

    from protos import specdec_pb2 as pb
    from protos import specdec_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            stub.GetInfo(pb.TargetServiceGetInfoRequest(), timeout=10)
            times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


class GrpcStack(Stack):
    """`specdec serve` target, draft(s) and coordinator(s) as child processes on loopback ports."""

    def __init__(self, target: str, drafters: tuple[str, ...], logs: pathlib.Path, device: str = "cpu",
                 tree: tuple[int, int] | None = None, weights: str = "fp32"):
        """`tree` (budget, top-k): model drafts also get a coordinator that drafts trees."""
        super().__init__(target, logs, device)
        addresses = {drafter: self.start_draft(drafter) for drafter in drafters}
        # the first model draft is the target's own (--draft): its coordinator's requests are drafted runs
        own = next((self.drafts_for_target(d, a) for d, a in addresses.items() if self.drafts_for_target(d, a)), [])
        self.start_target("--weights", weights, *own)
        self.coordinators: dict[str, str] = {}
        self.tree_coordinators: dict[str, str] = {}
        self.ngram_in_coordinator: str | None = None
        for drafter, draft_address in addresses.items():
            self.coordinators[drafter] = self.start_coordinator(draft_address)
            if drafter == "ngram":  # and prompt lookup inside the coordinator: no draft service, one hop a step
                self.ngram_in_coordinator = self.start_coordinator("ngram")
            if tree is not None and drafter != "ngram":
                self.tree_coordinators[drafter] = self.start_coordinator(draft_address, "--tree-budget", str(tree[0]),
                                                                         "--tree-top-k", str(tree[1]))
        self.wait()


# --- the run --------------------------------------------------------------------------------------

def short_name(drafter: str) -> str:
    return "ngram" if drafter == "ngram" else pathlib.Path(drafter.rstrip("/")).name or drafter


def build_configurations(opts: Options, target_spec: str, target_loaded, lm, drafters: tuple[str, ...],
                         stack: GrpcStack | None, notes: dict, weights: str = "fp32",
                         engines: dict | None = None) -> tuple[list[Configuration], dict]:
    """Every configuration with its runner; also the draft engines (for measuring their cost).

    `weights`: the format `lm`'s target reads; with several formats in one run each builds its own
    specdec rows (named name@format); the caller asks for the transformers rows (opts.hf) with the
    first format only, as they run fp32 whatever the format."""
    configs, engines = _build_configurations(opts, target_spec, target_loaded, lm, drafters, stack, notes, engines or {})
    several = len(opts.weights) > 1 or opts.weights != ("fp32",)
    for config in configs:
        if config.kind not in ("hf", "hf-assisted"):
            config.weights = weights
            if several:
                config.name = f"{config.name}@{weights}"
    return configs, engines


def _build_configurations(opts: Options, target_spec: str, target_loaded, lm, drafters: tuple[str, ...],
                          stack: GrpcStack | None, notes: dict, engines: dict) -> tuple[list[Configuration], dict]:
    from specdec.maths.costs import MODEL_DRAFT_PRIOR, NGRAM_DRAFT_PRIOR, CostModel
    from coordinator.local import LocalProposer, LocalVerifier
    from coordinator.loop import SpeculativeLoop
    from specdec.calls.request import TreeSettings
    from draft_service.drafters.model import ModelDrafter
    from draft_service.servicer import load_engine_with_model_info
    from specdec.model.loading import load_model, pruned_draft_folder
    from specdec.model.pruned import hf_assistant
    from target_service.engine import TargetEngine

    eos = lm.eos_token_ids
    verifier = LocalVerifier(TargetEngine(lm))
    configs: list[Configuration] = []
    if opts.hf:
        configs.append(Configuration("hf", "hf", runner=hf_runner(target_loaded.model, opts.max_new_tokens, eos)))
    off_loop = SpeculativeLoop(verifier, None, None, NGRAM_DRAFT_PRIOR)
    configs.append(Configuration("specdec-off", "specdec-off", runner=local_runner(off_loop, opts.max_new_tokens, eos, 0, False)))
    if lm.fixed_shape:  # on a GPU: what the exact passes cost against transformers' forward
        from specdec.model.lm import CausalLM

        fast = SpeculativeLoop(LocalVerifier(TargetEngine(CausalLM(target_loaded.model, lm.device))), None, None, NGRAM_DRAFT_PRIOR)
        configs.append(Configuration("specdec-off[numerics=fast]", "specdec-off", runner=local_runner(fast, opts.max_new_tokens, eos, 0, False),
                                     note="transformers' forward on the GPU: not row-exact"))
    for drafter in drafters:
        name = short_name(drafter)
        config = draft_config(drafter, target_spec, opts.device)  # as the gRPC stack's draft service runs it
        if drafter not in engines:  # one engine per draft, shared by every weight format's rows
            engines[drafter] = load_engine_with_model_info(config)[0]
        engine = engines[drafter]
        prior = NGRAM_DRAFT_PRIOR if drafter == "ngram" else MODEL_DRAFT_PRIOR
        features = engine.drafter.needs_features  # a feature draft (specdec/model/feature_draft.py)
        if opts.hf:
            if features:
                notes[f"hf-assisted[{name}]"] = ("skipped: transformers' assisted generation has no way to hand the "
                                                 "target's hidden states to the draft")
            elif drafter == "ngram":
                kwargs = {"prompt_lookup_num_tokens": opts.prompt_lookup}
                configs.append(Configuration(f"hf-assisted[{name}]", "hf-assisted", drafter, opts.prompt_lookup,
                                             runner=hf_runner(target_loaded.model, opts.max_new_tokens, eos, **kwargs),
                                             note=f"prompt_lookup_num_tokens={opts.prompt_lookup}"))
            else:
                try:
                    pruned = pruned_draft_folder(drafter)
                    if pruned is not None:  # a distilled pruned-head draft, wrapped as a transformers model
                        assistant = hf_assistant(pruned, target_spec)
                    else:
                        assistant_loaded = load_model(drafter, opts.device)
                        theirs, ours = assistant_loaded.tokenizer, target_loaded.tokenizer
                        if theirs is not None and ours is not None and theirs.get_vocab() != ours.get_vocab():
                            raise ValueError("its vocabulary differs from the target's (specdec maps it; transformers would "
                                             "need universal assisted decoding)")
                        assistant = assistant_loaded.model
                    configs.append(Configuration(f"hf-assisted[{name}]", "hf-assisted", drafter,
                                                 runner=hf_runner(target_loaded.model, opts.max_new_tokens, eos, assistant_model=assistant),
                                                 note="assistant_model= the same draft"))
                except Exception as exc:  # noqa: BLE001 - a draft transformers cannot load as an assistant
                    notes[f"hf-assisted[{name}]"] = f"skipped: transformers cannot use this draft as assistant_model ({exc})"
        loop = SpeculativeLoop(verifier, LocalProposer(engine), CostModel(prior), prior, features=features,
                               calibrated=drafter == "ngram", lookup=drafter == "ngram")  # as the coordinator sets them from the draft's ModelInfo
        configs.append(Configuration(f"specdec-local[{name}]", "specdec-local", drafter, opts.max_draft, True,
                                     runner=local_runner(loop, opts.max_new_tokens, eos, opts.max_draft, True), note="adaptive"))
        for g in opts.draft_lengths:
            fixed = SpeculativeLoop(verifier, LocalProposer(engine), None, prior, features=features)
            configs.append(Configuration(f"specdec-local[{name},g={g}]", "specdec-local", drafter, g, False,
                                         runner=local_runner(fixed, opts.max_new_tokens, eos, g, False)))
        if drafter != "ngram":  # an n-gram drafter has one guess per position: its tree is its chain
            for budget in opts.tree_budgets:
                fixed = SpeculativeLoop(verifier, LocalProposer(engine), None, prior, features=features)
                configs.append(Configuration(f"tree[{name},n={budget},g={opts.max_draft}]", "tree", drafter, opts.max_draft, False,
                                             runner=local_runner(fixed, opts.max_new_tokens, eos, opts.max_draft, False,
                                                                 TreeSettings(budget, opts.tree_top_k)),
                                             note=f"dynamic tree: {budget} nodes, top-{opts.tree_top_k}, depth <= {opts.max_draft}"))
            if opts.staged and isinstance(engine.drafter, ModelDrafter) and not features:  # not another vocabulary's
                staged_engine, _ = load_engine_with_model_info(dataclasses.replace(config, staged=True))
                for g in opts.draft_lengths:
                    fixed = SpeculativeLoop(verifier, LocalProposer(staged_engine), None, prior)
                    configs.append(Configuration(f"staged[{name},g={g}]", "staged", drafter, g, False,
                                                 runner=local_runner(fixed, opts.max_new_tokens, eos, g, False),
                                                 note="n-gram guesses checked by the draft model"))
        if stack is not None:
            configs.append(Configuration(f"specdec-grpc[{name}]", "specdec-grpc", drafter, opts.max_draft, True, hops=2,
                                         runner=grpc_runner(stack.coordinators[drafter], opts.max_new_tokens, opts.max_draft, True),
                                         note="adaptive; 3 processes on loopback"))
            if drafter == "ngram" and stack.ngram_in_coordinator:
                configs.append(Configuration("specdec-grpc[ngram,in-coordinator]", "specdec-grpc", drafter, opts.max_draft, True, hops=1,
                                             runner=grpc_runner(stack.ngram_in_coordinator, opts.max_new_tokens, opts.max_draft, True),
                                             note="adaptive; coordinator --draft ngram + target, 2 processes on loopback"))
            if drafter in stack.tree_coordinators:
                budget = opts.tree_budgets[0]
                configs.append(Configuration(f"tree-grpc[{name},n={budget},g={opts.max_draft}]", "tree", drafter, opts.max_draft, False, hops=2,
                                             runner=grpc_runner(stack.tree_coordinators[drafter], opts.max_new_tokens, opts.max_draft, False),
                                             note=f"dynamic tree over gRPC: {budget} nodes, top-{opts.tree_top_k}; 3 processes on loopback"))
    return configs, engines


def gguf_linear_types(path: pathlib.Path) -> list[str]:
    """The types a GGUF file stores its matrices in, most used first ("Q4_1", "Q8_0")."""
    import collections

    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2)
    return [name for name, _ in counts.most_common()]


def peer_configurations(opts: Options, target_spec: str, eos: list[int], notes: dict) -> list[Configuration]:
    """llama.cpp on the GGUF file the target comes from, plain and with its prompt lookup (2 threads,
    as specdec gets on the machines we measure): the engine CPU users would pick instead."""
    if not opts.llamacpp:
        return []
    from specdec_tools import bench_llamacpp

    reason = bench_llamacpp.unavailable_reason()
    gguf = bench_llamacpp.gguf_for(target_spec) if reason is None else None
    if reason is None and gguf is None:
        reason = f"the target {target_spec} does not come from a GGUF file"
    if reason is not None:
        notes["llama.cpp"] = f"skipped: {reason}"
        return []
    weights = f"gguf:{'+'.join(gguf_linear_types(gguf))}"
    configs = [Configuration("llama.cpp", "llamacpp", weights=weights, note=f"{gguf.name}, 2 threads",
                             runner=bench_llamacpp.llamacpp_runner(gguf, opts.max_new_tokens, eos))]
    configs.append(Configuration("llama.cpp[prompt-lookup]", "llamacpp", "ngram", opts.prompt_lookup, weights=weights,
                                 note=f"LlamaPromptLookupDecoding(num_pred_tokens={opts.prompt_lookup})",
                                 runner=bench_llamacpp.llamacpp_runner(gguf, opts.max_new_tokens, eos, prompt_lookup=opts.prompt_lookup)))
    return configs



def run(opts: Options, argv: list[str]) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdec_tools.bench_report import report
    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.loading import load_tokenizer

    torch.manual_seed(0)
    opts.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp:
        target, drafters = opts.target, opts.drafters
        if opts.quick:
            target, draft = quick_models(pathlib.Path(tmp))
            drafters = ("ngram", draft)
        print(f"specdec bench: loading {target}", file=sys.stderr, flush=True)
        # specdec's own configurations run the target as its service does (--numerics exact); hf_runner
        # switches the kernel off (and computes with the fp32 weights whatever the format: the reference
        # every format is held to)
        served = load_lm(LMOptions(model=target, device=opts.device, weights=opts.weights[0]))
        loaded, lm = served.loaded, served.lm
        tokenizer = loaded.tokenizer or load_tokenizer(target)
        formats = {opts.weights[0]: (loaded, lm, served.packed)}
        for weights in opts.weights[1:]:  # a model of its own per format: each layer holds one compact weight
            other = load_lm(LMOptions(model=target, device="cpu", weights=weights))
            formats[weights] = (other.loaded, other.lm, other.packed)
        prompts = {name: load_prompts(tokenizer, name, opts.limit) for name in opts.prompt_sets}
        if opts.per_kind:
            prompts = by_kind(prompts)
            opts = dataclasses.replace(opts, prompt_sets=tuple(prompts))  # the report's sets are the kinds
        if lm.max_context:  # tiny test models have short contexts: keep each prompt's tail
            room = lm.max_context - opts.max_new_tokens - opts.max_draft - 2
            prompts = {k: [(pid, ids[-room:]) for pid, ids in v] for k, v in prompts.items()}
        notes: dict[str, str] = {}
        tree = (opts.tree_budgets[0], opts.tree_top_k) if opts.tree_budgets else None
        stack = GrpcStack(target, drafters, opts.out / "logs", opts.device, tree=tree, weights=opts.weights[0]) if opts.grpc else None
        try:
            configs, engines = [], {}
            for i, (weights, (model_f, lm_f, _)) in enumerate(formats.items()):
                made, engines = build_configurations(opts if i == 0 else dataclasses.replace(opts, hf=False), target, model_f, lm_f,
                                                     drafters, stack if i == 0 else None, notes, weights, engines)
                configs += made
            configs += peer_configurations(opts, target, lm.eos_token_ids, notes)
            longest = max([opts.max_draft, *opts.draft_lengths]) + 1
            ns = sorted({1, 2, 3, 4, 5, 6, 8, 9, 12, 16, longest})
            room = lm.max_context - max(ns) - 1 if lm.max_context else None
            contexts = {name: curve_context(items, opts.max_new_tokens, room) for name, items in prompts.items()}
            context = next(iter(prompts.values()))[0][1]
            print("specdec bench: measuring the drafts' cost", file=sys.stderr, flush=True)
            draft_cost = {d: measure_draft_cost(e, context) for d, e in engines.items() if d != "ngram"}
            rtt = measure_rtt(stack.target_address) if stack is not None else 0.0
            results = {(s, c.name): Result(c, s) for s in prompts for c in configs}
            total = opts.repeats * sum(len(p) for p in prompts.values()) * len(configs)
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          transient=False) as progress:
                warm = progress.add_task("warm-up", total=len(configs) * len(prompts))
                for items in prompts.values():
                    for config in configs:
                        config.runner(items[0][1])  # untimed: lazy initialisation, caches, first compile
                        progress.advance(warm)
                task = progress.add_task("benchmark", total=total)
                for rep in range(opts.repeats):
                    for set_name, items in prompts.items():
                        # V(n) drifts with this shared machine by 20% within minutes: every pass is
                        # predicted from the curves measured right before and right after it.
                        # each weight format's rows are predicted from its own target's curve
                        curve_lm = {w: lm_f for w, (_, lm_f, _) in formats.items()}
                        before, before_weights = None, None
                        for config in configs:  # interleaved: every configuration once per repetition
                            progress.update(task, description=f"rep {rep + 1}/{opts.repeats} {set_name} {config.name}")
                            target_lm = curve_lm.get(config.weights, lm)
                            if before is None or before_weights != config.weights:
                                before = measure_cost_curve(target_lm, contexts[set_name], ns, repeats=2)
                            samples = []
                            for _, ids in items:
                                samples.append(config.runner(ids))
                                progress.advance(task)
                            after = measure_cost_curve(target_lm, contexts[set_name], ns, repeats=2)
                            results[(set_name, config.name)].samples.append(samples)
                            results[(set_name, config.name)].curves += [before, after]
                            before, before_weights = after, config.weights
                            if not progress.console.is_terminal:  # a log file gets one line per pass instead of a bar
                                rate = sum(len(x.tokens) for x in samples) / sum(x.seconds for x in samples)
                                print(f"rep {rep + 1}/{opts.repeats} {set_name:<9} {config.name:<28} {rate:7.2f} tok/s",
                                      file=sys.stderr, flush=True)
        finally:
            if stack is not None:
                stack.stop()
        context_info = {"draft_cost": draft_cost, "rtt": rtt, "notes": notes, "machine": machine(),
                        "weights": {w: {"weight_bytes": p.weight_bytes if p else gemm.linear_bytes(m.model),
                                        "stored_as": p.sources if p else {}, **held_as(m.model)} for w, (m, _, p) in formats.items()},
                        "command": "specdec bench " + " ".join(argv), "target": opts.target if not opts.quick else "tiny (quick)",
                        "drafters": [short_name(d) for d in drafters], "prompts": {k: [pid for pid, _ in v] for k, v in prompts.items()}}
        return report(list(results.values()), context_info, opts)


def held_as(model: torch.nn.Module) -> dict[str, str]:
    """The dtype and device the weights compute in: the "weights" column names the CPU kernel's
    format, which a GPU run does not use (its model computes in its own dtype, bf16 by default)."""
    parameter = next(model.parameters())
    return {"dtype": str(parameter.dtype).removeprefix("torch."), "device": str(parameter.device)}


def by_kind(prompts: dict[str, list[tuple[str, list[int]]]]) -> dict[str, list[tuple[str, list[int]]]]:
    """Each set split by kind of prompt, `SET:KIND`, KIND being a prompt's id before its last "-N"
    ("translation-1" -> "translation"): the check that speculation pays, or at least costs nothing,
    on each kind of task, which one figure over a mixed set hides."""
    out: dict[str, list[tuple[str, list[int]]]] = {}
    for name, items in prompts.items():
        for pid, ids in items:
            out.setdefault(f"{name}:{pid.rsplit('-', 1)[0]}", []).append((pid, ids))
    return out


def parse(argv: list[str]) -> Options:
    from specdec.model.loading import DEFAULT_TARGET

    parser = argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target-model", default=DEFAULT_TARGET, help="Target model: alias, folder, .gguf or hub id.")
    flags.deprecated_alias(parser, "--target", "target_model", "--target-model")  # `--target` is an address in `specdec serve coordinator`
    parser.add_argument("--drafter", action="append", default=None,
                        help="'ngram' or a draft model (alias/folder/hub id); repeat for several. Default: ngram.")
    parser.add_argument("--prompts", default=",".join(PROMPT_SETS), help=f"Comma-separated prompt sets from {PROMPTS_DIR}.")
    parser.add_argument("--limit", type=int, default=0, help="Use only the first N prompts of each set (0: all).")
    parser.add_argument("--per-kind", action="store_true",
                        help="Report each kind of prompt of a set (its id before the last '-N', e.g. the six of 'categories') as a set of its own.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="Interleaved repetitions of every configuration.")
    parser.add_argument("--max-draft", type=int, default=8, help="Draft length cap of the adaptive configurations.")
    parser.add_argument("--draft-lengths", default="2,4,8", help="Fixed draft lengths swept in one process ('' for none).")
    parser.add_argument("--prompt-lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens (its documented value).")
    parser.add_argument("--no-grpc", action="store_true", help="Skip the three-process gRPC configuration.")
    parser.add_argument("--no-hf", action="store_true", help="Skip transformers' generate() and assisted generation.")
    parser.add_argument("--tree-budgets", default="16,32", help="Node budgets of the dynamic-tree configurations of each model draft ('' for none).")
    parser.add_argument("--tree-top-k", type=int, default=8, help="Children per expanded node of those trees (8 beat 4 on tokens per pass with the 75-step distilled SmolLM2 draft).")
    parser.add_argument("--no-staged", action="store_true", help="Skip the staged-drafting configurations.")
    parser.add_argument("--weights", default="fp32",
                        help=f"Comma-separated formats the target's kernel reads its weights as ({', '.join(FORMATS)}): each "
                             "gets its own specdec rows, checked against the same format with speculation off and "
                             "compared with fp32's greedy tokens; the first also serves the gRPC rows.")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where every model of the run computes (services "
                        "included). On CUDA a specdec-off row with --numerics fast runs beside the exact one.")
    parser.add_argument("--no-llamacpp", action="store_true",
                        help="Skip llama.cpp's rows (run where llama-cpp-python is installed and the target comes from a GGUF file).")
    parser.add_argument("--out", default=None,
                        help=f"Folder for results.json and the PNG plots; default: a new {flags.RESULTS_ROOT}/bench-TIMESTAMP/ "
                             "(the committed runs are under benchmarks/results/).")
    parser.add_argument("--quick", action="store_true",
                        help="Tiny random models, 2 prompts per set, 16 tokens, 1 repetition: checks the pipeline in about a minute.")
    flags.finish(parser)
    args = parser.parse_args(argv)
    try:
        lengths = tuple(int(x) for x in args.draft_lengths.split(",") if x.strip())
    except ValueError:
        parser.error(f"--draft-lengths: expected comma-separated integers, got {args.draft_lengths!r}")
    try:
        budgets = tuple(int(x) for x in args.tree_budgets.split(",") if x.strip())
    except ValueError:
        parser.error(f"--tree-budgets: expected comma-separated integers, got {args.tree_budgets!r}")
    if any(not 1 <= b <= 64 for b in budgets) or not 1 <= args.tree_top_k <= 16:
        parser.error("--tree-budgets must be in 1..64 and --tree-top-k in 1..16")
    weights = tuple(dict.fromkeys(w.strip() for w in args.weights.split(",") if w.strip()))
    if not weights or any(w not in FORMATS for w in weights):
        parser.error(f"--weights: comma-separated formats from {', '.join(FORMATS)}, got {args.weights!r}")
    sets = tuple(s.strip() for s in args.prompts.split(",") if s.strip())
    for name in sets:
        if not prompt_path(name).is_file():
            parser.error(f"--prompts: no prompt set {name!r} in {PROMPTS_DIR}")
    if any(g < 1 or g > 32 for g in (*lengths, args.max_draft)):
        parser.error("draft lengths must be in 1..32")
    if args.repeats < 1 or args.max_new_tokens < 1 or args.limit < 0:
        parser.error("--repeats and --max-new-tokens must be >= 1, --limit >= 0")
    opts = Options(target=args.target_model, drafters=tuple(args.drafter or ["ngram"]), prompt_sets=sets, limit=args.limit,
                   max_new_tokens=args.max_new_tokens, repeats=args.repeats, max_draft=args.max_draft, draft_lengths=lengths,
                   grpc=not args.no_grpc, hf=not args.no_hf, out=pathlib.Path(args.out or flags.fresh_out("bench")), quick=args.quick,
                   prompt_lookup=args.prompt_lookup, tree_budgets=budgets, tree_top_k=args.tree_top_k, staged=not args.no_staged,
                   weights=weights, llamacpp=not args.no_llamacpp, device=args.device, per_kind=args.per_kind)
    if opts.device != "cpu" and (len(weights) > 1 or weights[0] != "fp32"):
        parser.error("--weights formats other than fp32 are for the CPU kernel; on a GPU the model's own dtype serves")
    if opts.quick:
        opts = dataclasses.replace(opts, limit=opts.limit or 2, max_new_tokens=min(opts.max_new_tokens, 16), repeats=1,
                                   draft_lengths=lengths[:1], tree_budgets=budgets[:1])
    return opts


def chain_tree_staged(document: dict) -> list[dict]:
    """Per prompt set and model draft: its best chain beside its trees and staged runs."""
    rows = []
    for set_name in document["prompts"]:
        records = [r for r in document["results"] if r["prompt_set"] == set_name and "mean_accepted_length" in r]
        for drafter, weights in sorted({(r["drafter"], r.get("weights", "fp32")) for r in records if r["kind"] in ("tree", "staged")}):
            mine = [r for r in records if r["drafter"] == drafter and r.get("weights", "fp32") == weights]
            chains = [r for r in mine if r["kind"] == "specdec-local"]
            if not chains:
                continue
            best = max(chains, key=lambda r: r["mean_accepted_length"])
            for r in [best] + [r for r in mine if r["kind"] in ("tree", "staged")]:
                rows.append({"prompt_set": set_name, "configuration": r["configuration"], "kind": "chain (best)" if r is best else r["kind"],
                             "tokens_per_step": r["mean_accepted_length"], "tokens_per_second": r["tokens_per_second"]["median"],
                             "tokens_per_step_vs_best_chain": r["mean_accepted_length"] / best["mean_accepted_length"],
                             "tokens_per_second_vs_best_chain": r["tokens_per_second"]["median"] / best["tokens_per_second"]["median"],
                             "identical": r.get("identical_to_baseline")})
    return rows


def print_chain_tree_staged(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if not rows:
        return
    table = Table(title="chain vs tree vs staged (mean accepted tokens per target pass = tokens/step)")
    for column in ("prompt set", "configuration", "kind", "tokens/step", "vs best chain", "tok/s", "vs best chain ", "identical"):
        table.add_column(column, justify="left" if column in ("prompt set", "configuration", "kind") else "right")
    for r in rows:
        ident = r["identical"]
        table.add_row(r["prompt_set"], escape(r["configuration"]), r["kind"], f"{r['tokens_per_step']:.2f}",
                      f"{r['tokens_per_step_vs_best_chain']:.2f}x", f"{r['tokens_per_second']:.1f}",
                      f"{r['tokens_per_second_vs_best_chain']:.2f}x", f"{ident['identical']}/{ident['runs']}" if ident else "")
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def main(argv: list[str]) -> int:
    if "--overlap" in argv:  # sequential vs overlapped speculation, services pinned apart
        from specdec_tools.bench_overlap import main as overlap_main

        return overlap_main(argv)
    if "--kernel" in argv:  # each weight format's linear layers against the memory's bandwidth
        from specdec_tools.bench_kernel import main as kernel_main

        return kernel_main(argv)
    opts = parse(argv)
    document = run(opts, argv)
    rows = chain_tree_staged(document)
    print_chain_tree_staged(rows)
    if rows:
        document["chain_tree_staged"] = rows
        (opts.out / "results.json").write_text(json.dumps(document, indent=2))
    return 0
