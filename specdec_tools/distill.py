"""`specdec distill`: train a small pruned-vocabulary draft for a target, on CPU, by distillation.

Why each stage exists:
- generate: the target's own greedy continuations of chat-templated prompts are the best data for
  acceptance (they are exactly the states the draft meets when drafting for that target), and
  generate() hands us the target's logits at every generated position for free.
- corpus: target logits over real text (batched prefill, which is cheap per token) add breadth.
- vocab: the head keeps the N most frequent target tokens of that data; the rest get p = 0.
- train: KL(target || draft) on the kept vocabulary (target top-k renormalised over it), from an
  initialisation copied from the target (its first layers, final norm, embedding rows as head).
- report: greedy acceptance on held-out prompts against the real target, and the draft's cost per
  token relative to one target token.
Every stage caches its output under --work-dir, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time

import torch

from specdec.model.hfcache import cache_kwargs
from specdec.model.formats import FORMATS
from specdec_tools import flags
from specdec.model.pruned import PrunedDraft, save_draft
from specdec_tools.distill_prompts import chat_ids, load_corpus, make_prompts, split_passages, target_eos
from specdec_tools.distill_training import _progress, data_dir, train_loop


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> (ids int32 [..., k], probs fp16 [..., k]) of the target's softmax."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids.to(torch.int32), probs.to(torch.float16)


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts: list[list[int]], max_new: int, k: int, eos: set[int]) -> list[dict]:
    """Greedy continuations of a batch (left-padded) with the target's top-k at each generated position.

    Record: tokens [L] (prompt + continuation), start = index of the first input position whose
    next-token distribution is stored, ids/probs [L - 1 - start, k].
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=pad, eos_token_id=sorted(eos))
    logits = torch.stack(out.logits, dim=1)  # [B, G, V]
    records = []
    for row, prompt in enumerate(prompts):
        gen = out.sequences[row, width:].tolist()
        n = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        ids, probs = _topk(logits[row, :n], k)
        records.append({"tokens": torch.tensor(prompt + gen[:n]), "start": len(prompt) - 1, "ids": ids, "probs": probs})
    return records


@torch.inference_mode()
def prefill_batch(model, windows: list[list[int]], k: int) -> list[dict]:
    """Target top-k over equal-length corpus windows in ONE forward pass (prefill is cheap per token)."""
    logits = model(input_ids=torch.tensor(windows)).logits[:, :-1]  # [B, T-1, V]
    ids, probs = _topk(logits, k)
    return [{"tokens": torch.tensor(w), "start": 0, "ids": ids[i], "probs": probs[i]} for i, w in enumerate(windows)]


def _shards(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("shard_*.pt"))


def build_data(args, model, tokenizer, passages: list[str], eos: set[int]) -> list[dict]:
    """Both data stages, one shard per batch on disk: a rerun skips the shards already there."""
    work = pathlib.Path(args.work_dir)
    common = {"target": args.target, "corpus": passages, "seed": args.seed, "topk": args.topk}
    gen_dir = data_dir(work / "gen", {**common, "prompts": args.gen_prompts, "batch": args.gen_batch, "tokens": args.gen_tokens})
    corpus_dir = data_dir(work / "corpus", {**common, "corpus_tokens": args.corpus_tokens, "seq_len": args.seq_len,
                                            "batch": args.prefill_batch})
    prompts = [chat_ids(tokenizer, p) for p in make_prompts(passages, args.gen_prompts, args.seed, heldout=False)]
    batches = [prompts[i: i + args.gen_batch] for i in range(0, len(prompts), args.gen_batch)]
    train_passages = split_passages(passages)[0]
    random.Random(args.seed).shuffle(train_passages)  # the token cap then samples every corpus file
    text = "\n\n".join(train_passages)
    corpus_ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.corpus_tokens]
    w = args.seq_len
    windows = [corpus_ids[i: i + w] for i in range(0, len(corpus_ids) - w + 1, w)]
    wbatches = [windows[i: i + args.prefill_batch] for i in range(0, len(windows), args.prefill_batch)]
    with _progress() as progress:
        task = progress.add_task("self-generated data", total=len(batches), info="")
        for i, batch in enumerate(batches):
            shard = gen_dir / f"shard_{i:05d}.pt"
            if not shard.exists():
                records = generate_batch(model, tokenizer, batch, args.gen_tokens, args.topk, eos)
                torch.save(records, shard.with_suffix(".tmp"))
                shard.with_suffix(".tmp").rename(shard)
            progress.update(task, advance=1, info=f"{len(batch)} prompts x {args.gen_tokens} tokens")
        task = progress.add_task("corpus logits", total=len(wbatches), info="")
        for i, batch in enumerate(wbatches):
            shard = corpus_dir / f"shard_{i:05d}.pt"
            if not shard.exists():
                torch.save(prefill_batch(model, batch, args.topk), shard.with_suffix(".tmp"))
                shard.with_suffix(".tmp").rename(shard)
            progress.update(task, advance=1, info=f"{len(batch)} x {w} tokens")
    data = []
    for shard in _shards(gen_dir)[: len(batches)] + _shards(corpus_dir)[: len(wbatches)]:
        data += torch.load(shard)
    return data


def kept_vocab(data: list[dict], size: int, vocab: int, always: set[int]) -> list[int]:
    """The `size` most frequent target tokens of the data (inputs and the target's top choices), ties by id."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for r in data:
        counts += torch.bincount(r["tokens"], minlength=vocab).double()
        counts += torch.bincount(r["ids"][..., 0].reshape(-1).long(), minlength=vocab).double()  # what the target predicts
    for t in always:
        counts[t] = float("inf")
    size = min(size, vocab)
    order = sorted(range(vocab), key=lambda t: (-counts[t].item(), t))
    return sorted(order[:size])


def init_draft(target, kept: list[int], layers: int) -> PrunedDraft:
    """Copies the target's first `layers` layers, final norm and (tied) output rows of the kept ids."""
    from transformers import LlamaConfig

    tcfg = target.config
    cfg = LlamaConfig(**{**tcfg.to_dict(), "num_hidden_layers": layers, "tie_word_embeddings": False,
                         "architectures": None, "torch_dtype": "float32"})
    draft = PrunedDraft(cfg, kept)
    body = target.model
    missing = set(draft.body.load_state_dict({**{f"layers.{i}.{k}": v for i in range(layers)
                                                  for k, v in body.layers[i].state_dict().items()},
                                              "norm.weight": body.norm.weight,
                                              "embed_tokens.weight": body.embed_tokens.weight}, strict=False).missing_keys)
    if missing - {"rotary_emb.inv_freq"}:
        raise ValueError(f"target is not Llama-shaped: could not initialise {sorted(missing)}")
    with torch.no_grad():
        draft.head.weight.copy_(target.get_output_embeddings().weight[torch.tensor(kept)])
    draft.body.embed_tokens.requires_grad_(False)  # shared with the target: never trained, never stored
    return draft


def make_batch(records: list[dict], lookup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs [B, T], target kept-index [B, T, k] (-1 outside), target probs [B, T, k], mask [B, T]."""
    length = max(len(r["tokens"]) - 1 for r in records)
    k = records[0]["ids"].shape[-1]
    inputs = torch.zeros(len(records), length, dtype=torch.long)
    idx = torch.full((len(records), length, k), -1, dtype=torch.long)
    probs = torch.zeros(len(records), length, k)
    for b, r in enumerate(records):
        n = len(r["tokens"]) - 1
        inputs[b, :n] = r["tokens"][:-1]
        s = r["start"]
        m = r["ids"].shape[0]
        idx[b, s: s + m] = lookup[r["ids"].long()]
        probs[b, s: s + m] = r["probs"].float()
    probs = probs * (idx >= 0)  # keep only the target's mass on the kept vocabulary ...
    total = probs.sum(-1, keepdim=True)
    mask = total[..., 0] > 0
    return inputs, idx.clamp(min=0), probs / total.clamp(min=1e-9), mask  # ... renormalised


def distill_loss(draft: PrunedDraft, batch) -> torch.Tensor:
    """Cross-entropy of the draft against the renormalised target distribution = KL + a constant."""
    inputs, idx, probs, mask = batch
    logp = torch.log_softmax(draft(inputs).logits.float(), dim=-1)  # [B, T, N]
    per_pos = -(logp.gather(-1, idx) * probs).sum(-1)  # [B, T]
    return (per_pos * mask).sum() / mask.sum().clamp(min=1)


def train(args, draft: PrunedDraft, data: list[dict], lookup: torch.Tensor) -> list[float]:
    return train_loop(args, draft, len(data), lambda chosen, _rng: (distill_loss(draft, make_batch([data[i] for i in chosen], lookup)), ""),
                      pathlib.Path(args.work_dir) / "checkpoint.pt", "distilling", lambda key: "embed_tokens" not in key)


def simulate_greedy(hits: list[bool], g: int) -> tuple[int, int, int]:
    """Speculative steps over a known target continuation: (steps, drafted, accepted) at draft length g.

    hits[j] says whether the draft's argmax after the target's first j tokens is the target's token j.
    With greedy decoding that is all that matters: an accepted token equals the target's, so the next
    draft position sees exactly the prefix the teacher-forced pass saw.
    """
    steps = drafted = accepted = pos = 0
    while pos < len(hits):
        k = 0
        while k < g and pos + k < len(hits) and hits[pos + k]:
            k += 1
        steps, drafted, accepted, pos = steps + 1, drafted + g, accepted + k, pos + k + 1
    return steps, drafted, accepted


@torch.inference_mode()
def measure_acceptance(target, draft: PrunedDraft, tokenizer, prompts: list[str], max_new: int, g: int, eos: set[int]) -> dict:
    steps = drafted = accepted = agree = total = 0
    for text in prompts:
        ids = chat_ids(tokenizer, text)
        record = generate_batch(target, tokenizer, [ids], max_new, 1, eos)[0]
        seq = record["tokens"]
        cont = seq[len(ids):]
        pred = draft.to_target_logits(draft(seq[None, :-1]).logits[0]).argmax(-1)[len(ids) - 1:]  # [len(cont)]
        hits = (pred == cont).tolist()
        s, d, a = simulate_greedy(hits, g)
        steps, drafted, accepted, agree, total = steps + s, drafted + d, accepted + a, agree + sum(hits), total + len(hits)
    return {"prompts": len(prompts), "draft_length": g, "target_tokens": total, "acceptance": accepted / max(drafted, 1),
            "accepted_per_step": accepted / max(steps, 1), "tokens_per_target_pass": total / max(steps, 1),
            "per_token_agreement": agree / max(total, 1)}


@torch.inference_mode()
def measure_cost(target, draft: PrunedDraft, context: int = 128, reps: int = 40) -> dict:
    """Median one-token forward (KV cache of `context` tokens) of draft and target, interleaved against noise."""
    from transformers import DynamicCache

    ids = torch.arange(100, 100 + context)[None]
    caches = {}
    for name, m in (("target", target), ("draft", draft)):
        cache = DynamicCache(config=m.config)
        m(input_ids=ids, **cache_kwargs(m, cache), use_cache=True)
        caches[name] = cache
    times: dict[str, list[float]] = {"target": [], "draft": []}
    nxt = torch.tensor([[42]])
    for _ in range(reps):
        for name, m in (("target", target), ("draft", draft)):
            start = time.perf_counter()
            m(input_ids=nxt, **cache_kwargs(m, caches[name]), use_cache=True, logits_to_keep=1)
            times[name].append(time.perf_counter() - start)
            caches[name].crop(-1)  # drop the timed token again
    t, d = statistics.median(times["target"]), statistics.median(times["draft"])
    return {"target_ms": t * 1e3, "draft_ms": d * 1e3, "draft_cost_c": d / t}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdec distill", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target-model", dest="target", default="smollm2-135m-instruct",
                   help="Target model: alias, folder, .gguf or hub id (Llama-shaped).")
    flags.deprecated_alias(p, "--target", "target", "--target-model")  # as in `specdec bench`
    p.add_argument("--corpus", action="append", default=[], help="Text file or folder (repeatable); default: the Debian fortunes.")
    p.add_argument("--out", required=True, help="Folder to write the draft to.")
    p.add_argument("--work-dir", default="", help="Cached data and checkpoints (default: <out>.work).")
    p.add_argument("--method", default="layers", choices=("layers", "feature"),
                   help="layers: a small Llama copied from the target's first layers, reading tokens only; feature: one "
                        "layer that drafts from the target's own hidden states (EAGLE-style, specdec/distill_feature.py).")
    p.add_argument("--layers", type=int, default=0,
                   help="Draft transformer layers; 0: the method's own (layers: 2, copied from the target's first ones; "
                        "feature: 1, from its last ones).")
    p.add_argument("--device", default="cpu",
                   help="Where the target generates the data and the draft trains: cpu, cuda or cuda:N. On CUDA the "
                        "target's features come from one padded pass per batch (not one per sequence) and training uses TF32.")
    p.add_argument("--vocab", type=int, default=8192, help="Kept vocabulary size of the pruned head.")
    p.add_argument("--gen-prompts", type=int, default=512, help="Chat prompts the target continues greedily (training data).")
    p.add_argument("--gen-tokens", type=int, default=128, help="New tokens per self-generated continuation.")
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--corpus-tokens", type=int, default=65536, help="Corpus tokens scored by the target (prefill).")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128, help="Corpus window length.")
    p.add_argument("--topk", type=int, default=16, help="Target probabilities kept per position.")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--data-budget-s", type=float, default=0.0,
                   help="feature: stop generating training data after this many seconds and train on what is there (0: no limit).")
    p.add_argument("--train-budget-s", type=float, default=0.0,
                   help="Fewer --steps if the first 20 show they would take longer than this (0: no limit).")
    p.add_argument("--heldout-prompts", type=int, default=24)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--draft-length", type=int, default=4, help="g for the acceptance report.")
    p.add_argument("--reg", type=float, default=1.0, help="feature: weight of the smooth-L1 pull towards the target's next feature.")
    p.add_argument("--unroll", type=int, default=1,
                   help="feature: training passes, pass k the k-th drafted token of every chain (fed predicted features).")
    p.add_argument("--feature-layers", default="",
                   help="feature: the target layers the draft reads, fused (EAGLE-3): 'low,mid,high' or indices 'i,j,k'; "
                        "default: the final hidden states.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="Stored weight dtype.")
    p.add_argument("--evaluate", action="store_true",
                   help="Train nothing: measure the draft already in --out (held-out acceptance, cost per token) and print it.")
    p.add_argument("--weights", default="fp32", choices=FORMATS,
                   help="feature, --evaluate: what the draft's linear layers are read as, as `specdec serve draft --weights` "
                        "serves it (int8-a8: its auto on a CPU); its agreement and cost are measured so.")
    flags.finish(p, env=False)  # a training run's flags belong on its command line, which the model card records
    return p.parse_args(argv)


def run(args: argparse.Namespace, command: str = "") -> dict:
    from specdec.model.loading import load_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.work_dir = args.work_dir or str(pathlib.Path(args.out).with_suffix(".work"))
    passages = load_corpus(args.corpus)  # fails early on a missing corpus
    loaded = load_model(args.target, "cpu", "float32")
    target, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise ValueError(f"target {args.target!r} has no tokenizer: distillation needs one to read the corpus")
    if getattr(target.config, "model_type", "") != "llama":
        raise ValueError(f"target {args.target!r} is a {target.config.model_type!r} model; distill copies Llama-shaped layers")
    args.layers = args.layers or 2
    if not 1 <= args.layers <= target.config.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {target.config.num_hidden_layers}]")
    eos = target_eos(target, tokenizer)
    t0 = time.perf_counter()
    data = build_data(args, target, tokenizer, passages, eos)
    t_data = time.perf_counter() - t0
    vocab = int(target.config.vocab_size)
    kept = kept_vocab(data, args.vocab, vocab, eos)
    lookup = torch.full((vocab,), -1, dtype=torch.long)
    lookup[torch.tensor(kept)] = torch.arange(len(kept))
    draft = init_draft(target, kept, args.layers)
    t1 = time.perf_counter()
    losses = train(args, draft, data, lookup)
    t_train = time.perf_counter() - t1
    heldout = make_prompts(passages, args.heldout_prompts, args.seed, heldout=True)
    acc = measure_acceptance(target, draft, tokenizer, heldout, args.eval_tokens, args.draft_length, eos)
    cost = measure_cost(target, draft)
    mass = float(sum(r["probs"].float()[(lookup[r["ids"].long()] >= 0)].sum() for r in data) /
                 sum(r["probs"].float().sum() for r in data))
    report = {"command": command, "target": args.target, "layers": args.layers, "kept_vocab": len(kept),
              "training_sequences": len(data), "training_positions": int(sum(r["ids"].shape[0] for r in data)),
              "target_topk_mass_kept": mass, "steps": args.steps, "batch": args.batch,
              "loss_first": statistics.fmean(losses[:20]) if losses else None,
              "loss_last": statistics.fmean(losses[-20:]) if losses else None,
              "data_seconds": t_data, "train_seconds": t_train, **acc, **cost}
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    save_draft(draft.float(), args.out, args.target, sorted(eos), dtype, extra={"report": report})
    (pathlib.Path(args.out) / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def evaluate(args: argparse.Namespace) -> dict:
    """Held-out acceptance and cost of an existing draft folder, as it is stored (its dtype, its head)."""
    from specdec.model.loading import load_model
    from specdec.model.pruned import load_draft

    torch.set_num_threads(args.threads)
    passages = load_corpus(args.corpus)
    loaded = load_model(args.target, "cpu", "float32")
    draft, _meta = load_draft(args.out, "cpu", torch.float32, target_override=args.target)
    eos = target_eos(loaded.model, loaded.tokenizer)
    heldout = make_prompts(passages, args.heldout_prompts, args.seed, heldout=True)
    acc = measure_acceptance(loaded.model, draft, loaded.tokenizer, heldout, args.eval_tokens, args.draft_length, eos)
    return {**acc, **measure_cost(loaded.model, draft), "layers": draft.config.num_hidden_layers, "kept_vocab": len(draft.kept_ids)}


def format_evaluation(r: dict) -> str:
    return "\n".join([
        f"draft: {r['layers']} layer{'s' if r['layers'] != 1 else ''}, {r['kept_vocab']}-token head"
        + (" over the target's hidden states" if r.get("method") == "feature" else "")
        + (f", weights {r['weights']}" if r.get("weights", "fp32") != "fp32" else ""),
        f"held-out ({r['prompts']} prompts, {r['target_tokens']} target tokens, greedy, draft length {r['draft_length']}):",
        f"  acceptance {r['acceptance']:.3f}, accepted per step {r['accepted_per_step']:.2f}, "
        f"tokens per target pass {r['tokens_per_target_pass']:.2f}, per-token agreement {r['per_token_agreement']:.3f}",
        f"cost: draft {r['draft_ms']:.2f} ms vs target {r['target_ms']:.2f} ms per token -> c = {r['draft_cost_c']:.3f}",
    ])


def format_report(r: dict) -> str:
    return "\n".join([
        f"draft: {r['layers']} layers, {r['kept_vocab']}-token head; target top-k mass kept by the head: {r['target_topk_mass_kept']:.3f}",
        f"data: {r['training_sequences']} sequences, {r['training_positions']} distilled positions ({r['data_seconds']:.0f} s)",
        f"training: {r['steps']} steps x {r['batch']}, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} ({r['train_seconds']:.0f} s)",
        f"held-out ({r['prompts']} prompts, {r['target_tokens']} target tokens, greedy, draft length {r['draft_length']}):",
        f"  acceptance {r['acceptance']:.3f}, accepted per step {r['accepted_per_step']:.2f}, "
        f"tokens per target pass {r['tokens_per_target_pass']:.2f}, per-token agreement {r['per_token_agreement']:.3f}",
        f"cost: draft {r['draft_ms']:.2f} ms vs target {r['target_ms']:.2f} ms per token -> c = {r['draft_cost_c']:.3f}",
    ])


def format_feature_report(r: dict) -> str:
    return "\n".join([
        f"feature draft: {r.get('layers', 1)} layer{'s' if r.get('layers', 1) != 1 else ''} over the target's hidden states, "
        f"{r['kept_vocab']}-token head",
        f"data: {r['training_sequences']} sequences, {r['training_positions']} positions ({r['data_seconds']:.0f} s on {r.get('device', 'cpu')})",
        f"training: {r['steps']} steps x {r['batch']}, unroll {r['unroll']}, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} "
        f"({r['train_seconds']:.0f} s)",
        f"held-out ({r['prompts']} prompts, {r['target_tokens']} target tokens, greedy, draft length {r['draft_length']}):",
        f"  acceptance {r['acceptance']:.3f}, accepted per step {r['accepted_per_step']:.2f}, "
        f"tokens per target pass {r['tokens_per_target_pass']:.2f}, per-token agreement {r['per_token_agreement']:.3f}",
        *([f"  taken at draft positions 1..{len(r['agreement_by_position'])}: "
           + ", ".join("-" if a is None else f"{a:.3f}" for a in r["agreement_by_position"])] if r.get("agreement_by_position") else []),
        f"cost: draft {r['draft_ms']:.2f} ms vs target {r['target_ms']:.2f} ms per token -> c = {r['draft_cost_c']:.3f}",
    ])


def main(argv: list[str]) -> int:
    import shlex
    import sys

    args = parse_args(argv)
    try:
        if args.method != "feature" and args.device != "cpu":
            raise ValueError("--device: only --method feature trains on a GPU; --method layers runs on cpu")
        if args.weights != "fp32" and not (args.method == "feature" and args.evaluate):
            raise ValueError("--weights: only --method feature --evaluate measures a draft in another format")
        if args.method == "feature":
            from specdec_tools import distill_feature

            if args.evaluate:
                print(format_evaluation(distill_feature.evaluate(args)))
                return 0
            report = distill_feature.run(args, "specdec distill " + shlex.join(argv))
            print(format_feature_report(report))
            return 0
        if args.evaluate:
            print(format_evaluation(evaluate(args)))
            return 0
        report = run(args, "specdec distill " + shlex.join(argv))
    except (FileNotFoundError, ValueError) as e:
        print(f"specdec distill: error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0
