"""`specdec distill --method feature`: train a feature draft (specdec/model/feature_draft.py) for a target, on CPU.

Stages, each cached under --work-dir so a killed run resumes:
- data: the target's greedy continuations of chat prompts (the states the draft meets when it
  drafts for this target), and the target's final hidden states at every position of prompt and
  continuation (one plain prefill per sequence: exact, and cheap next to generation).
- vocab: the head keeps the N most frequent tokens of that data (eos always).
- train: at each position i the draft sees (f_i, x_{i+1}) and must predict f_{i+1}: cross-entropy
  against the target's own distribution there (its head on f_{i+1}, over the kept vocabulary) plus
  a smooth-L1 pull towards f_{i+1} itself. `--unroll 2` also trains a second pass that sees the
  first pass's predictions instead of the true features, as drafting beyond one token does.
- report: greedy acceptance at draft length g on held-out prompts, simulated step by step exactly as
  the draft service drafts (true features up to the last verified position, predicted after), and
  the draft's cost per token relative to one target token.
"""

from __future__ import annotations

import json
import pathlib
import random
import statistics
import time

import torch

from specdec_tools.distill_prompts import chat_ids, load_corpus, make_prompts, target_eos
from specdec_tools.distill_training import _progress, data_dir, train_loop
from specdec.model.hfcache import cache_kwargs
from specdec.kv.store import crop_to
from specdec.model.feature_draft import FeatureDraft, init_from_target, save_feature_draft
from specdec.model.loading import resolve_device


@torch.inference_mode()
def generate_with_features(model, tokenizer, prompts: list[list[int]], max_new: int, eos: set[int],
                           batched: bool | None = None) -> list[dict]:
    """Greedy continuations of a left-padded batch, then each row's final hidden states [L, H].

    On CPU the features come from one unpadded pass per row: exactly those of the sequence alone.
    On a GPU one right-padded pass over the batch: a causal model's real positions never see the
    pads after them, so only the kernels' batch-dependent rounding differs, and a per-row loop
    would leave the GPU idle.
    """
    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         pad_token_id=pad, eos_token_id=sorted(eos)).cpu()
    sequences = []
    for row, prompt in enumerate(prompts):
        gen = out[row, width:].tolist()
        n = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        sequences.append(prompt + gen[:n])
    if not (device.type != "cpu" if batched is None else batched):
        feats = [model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0] for tokens in sequences]
    else:
        longest = max(map(len, sequences))
        padded = torch.tensor([t + [pad] * (longest - len(t)) for t in sequences], device=device)
        hidden = model.model(input_ids=padded).last_hidden_state.to(torch.float16).cpu()
        feats = [hidden[row, : len(t)] for row, t in enumerate(sequences)]
    return [{"tokens": torch.tensor(tokens, dtype=torch.int32), "prompt_len": len(prompt), "feat": f.to(torch.float16).clone()}
            for tokens, prompt, f in zip(sequences, prompts, feats)]


def build_data(args, model, tokenizer, passages: list[str], eos: set[int], heldout: bool = False) -> list[dict]:
    count = args.heldout_prompts if heldout else args.gen_prompts
    tokens = args.eval_tokens if heldout else args.gen_tokens
    work = data_dir(pathlib.Path(args.work_dir) / ("heldout" if heldout else "features"),
                    {"target": args.target, "corpus": passages, "seed": args.seed, "prompts": count,
                     "batch": args.gen_batch, "tokens": tokens, "device": model.device.type})
    texts = make_prompts(passages, count, args.seed, heldout=heldout)
    prompts = [chat_ids(tokenizer, p) for p in texts]
    batches = [prompts[i: i + args.gen_batch] for i in range(0, len(prompts), args.gen_batch)]
    data: list[dict] = []
    budget = 0.0 if heldout else getattr(args, "data_budget_s", 0.0)
    start = time.perf_counter()
    with _progress() as progress:
        task = progress.add_task("held-out continuations" if heldout else "target continuations + features", total=len(batches), info="")
        for i, batch in enumerate(batches):
            shard = work / f"shard_{i:05d}.pt"
            if budget and data and time.perf_counter() - start > budget:
                # the rest of the time is the training's: train on the shards made so far
                progress.update(task, info=f"--data-budget-s {budget:.0f} spent: {i} of {len(batches)} batches")
                break
            if not shard.exists():
                torch.save(generate_with_features(model, tokenizer, batch, tokens, eos), shard.with_suffix(".tmp"))
                shard.with_suffix(".tmp").rename(shard)
            data += torch.load(shard)
            progress.update(task, advance=1, info=f"{len(batch)} prompts x {tokens} tokens")
    return data


def kept_vocab(data: list[dict], size: int, vocab: int, always: set[int]) -> list[int]:
    counts = torch.zeros(vocab, dtype=torch.float64)
    for r in data:
        counts += torch.bincount(r["tokens"].long(), minlength=vocab).double()
    for t in always:
        counts[t] = float("inf")
    order = sorted(range(vocab), key=lambda t: (-counts[t].item(), t))
    return sorted(order[: min(size, vocab)])


def make_batch(records: list[dict], max_len: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [B, T, H], tokens [B, T], mask [B, T-1]) of random windows of at most max_len positions."""
    length = min(max_len, max(len(r["tokens"]) for r in records))
    hidden = records[0]["feat"].shape[1]
    feats = torch.zeros(len(records), length, hidden)
    tokens = torch.zeros(len(records), length, dtype=torch.long)
    mask = torch.zeros(len(records), length - 1)
    for b, r in enumerate(records):
        n = len(r["tokens"])
        s = rng.randint(0, max(0, n - length))
        e = min(n, s + length)
        feats[b, : e - s] = r["feat"][s:e].float()
        tokens[b, : e - s] = r["tokens"][s:e].long()
        mask[b, : e - s - 1] = 1
    return feats, tokens, mask


def feature_loss(draft: FeatureDraft, head: torch.Tensor, batch, reg: float, unroll: int) -> tuple[torch.Tensor, float]:
    """Mean over unroll passes of CE(target dist | draft) + reg * smooth-L1(predicted f, true f).

    head [N, H]: the TARGET's output rows of the kept ids, so the soft label is the target's own
    distribution at i+1. Returns the loss and the first pass's argmax agreement with the target.
    """
    feats, tokens, mask = batch
    inputs, following, wanted = feats[:, :-1], tokens[:, 1:], feats[:, 1:]
    with torch.no_grad():
        label = torch.softmax(wanted @ head.T, dim=-1)
    total, agreement, seen = 0.0, 0.0, inputs
    for u in range(unroll):
        predicted, logits = draft(seen, following)
        m = mask.clone()
        m[:, :u] = 0  # pass u has no prediction to stand on for its first u positions
        ce = -(torch.log_softmax(logits, dim=-1) * label).sum(-1)
        l1 = torch.nn.functional.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
        total = total + ((ce + reg * l1) * m).sum() / m.sum().clamp(min=1)
        if u == 0:
            agreement = float(((logits.argmax(-1) == label.argmax(-1)).float() * m).sum() / m.sum().clamp(min=1))
        seen = torch.cat([inputs[:, :1], predicted[:, :-1]], dim=1)  # position i now sees the prediction of f_i
    return total / unroll, agreement


def train(args, draft: FeatureDraft, head: torch.Tensor, data: list[dict]) -> list[float]:
    """distill.train_loop over random windows of the data; the progress bar also shows agreement."""
    agreements: list[float] = []

    device = next(draft.fc.parameters()).device
    head = head.to(device)

    def loss_of(chosen: list[int], rng: random.Random):
        batch = [t.to(device, non_blocking=True) for t in make_batch([data[i] for i in chosen], args.seq_len, rng)]
        loss, agreement = feature_loss(draft, head, batch, args.reg, args.unroll)
        agreements.append(agreement)
        return loss, f", agreement {statistics.fmean(agreements[-20:]):.3f}"

    return train_loop(args, draft, len(data), loss_of, pathlib.Path(args.work_dir) / "feature_checkpoint.pt",
                      "training the feature draft", lambda key: not key.startswith("embed."))


@torch.inference_mode()
def chain_hits(draft: FeatureDraft, record: dict, g: int) -> tuple[int, int, int]:
    """(steps, drafted, accepted) of greedy speculation over one held-out record, drafting as the
    draft service does: true features up to the last verified position, its own predictions after."""
    device = draft.kept_ids.device
    tokens, feats, start = record["tokens"].long().to(device), record["feat"].float().to(device), record["prompt_len"]
    n = len(tokens)
    cache = draft.new_cache()
    # The first step drafts nothing, as in the loop: the prompt's features come from the target's
    # prefill, which also gives the first token.
    steps = drafted = accepted = 0
    pos = start  # canonical tokens x_0 .. x_{pos-1}; true features f_0 .. f_{pos-2}
    if pos < n:
        steps, pos = 1, pos + 1
    if pos > 2:
        draft(feats[None, : pos - 2], tokens[None, 1: pos - 1], cache, use_cache=True)  # pairs 0 .. pos-3
    while pos < n:
        kept = cache.get_seq_length()
        feature, token = feats[None, pos - 2: pos - 1], tokens[None, pos - 1: pos]
        k, width = 0, min(g, n - pos - 1)  # as the loop: the last token is always the target's own
        for j in range(width):
            feature, logits = draft(feature, token, cache, use_cache=True)
            guess = int(draft.kept_ids[logits[0, -1].argmax()])
            if guess != int(tokens[pos + j]):
                break
            k, token = k + 1, torch.tensor([[guess]], device=device)
        steps, drafted, accepted = steps + 1, drafted + width, accepted + k
        crop_to(cache, kept)
        after = min(n, pos + k + 1)
        draft(feats[None, pos - 2: after - 2], tokens[None, pos - 1: after - 1], cache, use_cache=True)  # the true pairs
        pos = after
    return steps, drafted, accepted


def measure_acceptance(draft: FeatureDraft, heldout: list[dict], g: int) -> dict:
    steps = drafted = accepted = positions = 0
    for record in heldout:
        s, d, a = chain_hits(draft, record, g)
        steps, drafted, accepted = steps + s, drafted + d, accepted + a
        positions += len(record["tokens"]) - record["prompt_len"]
    one = [chain_hits(draft, r, 1) for r in heldout]
    return {"prompts": len(heldout), "draft_length": g, "target_tokens": positions, "acceptance": accepted / max(drafted, 1),
            "accepted_per_step": accepted / max(steps, 1), "tokens_per_target_pass": positions / max(steps, 1),
            "per_token_agreement": sum(a for _, _, a in one) / max(sum(d for _, d, _ in one), 1)}


@torch.inference_mode()
def measure_cost(target, draft: FeatureDraft, context: int = 128, reps: int = 40) -> dict:
    """Median time of one drafted token (a pair forward over a warm cache, the head, the argmax over
    the target vocabulary) against one target token, interleaved against noise."""
    from transformers import DynamicCache

    device = draft.kept_ids.device
    ids = torch.arange(100, 100 + context, device=device)[None]
    tcache = DynamicCache(config=target.config)
    target(input_ids=ids, **cache_kwargs(target, tcache), use_cache=True)
    dcache = draft.new_cache()
    hidden = draft.config.hidden_size
    draft(torch.zeros(1, context, hidden, device=device), ids, dcache, use_cache=True)
    times: dict[str, list[float]] = {"target": [], "draft": []}
    nxt, feature = torch.tensor([[42]], device=device), torch.zeros(1, 1, hidden, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        target(input_ids=nxt, **cache_kwargs(target, tcache), use_cache=True, logits_to_keep=1)
        sync()
        times["target"].append(time.perf_counter() - start)
        crop_to(tcache, context)
        start = time.perf_counter()
        _, logits = draft(feature, nxt, dcache, use_cache=True)
        int(draft.to_target_logits(logits[0, -1]).argmax())  # the int() waits for the device
        times["draft"].append(time.perf_counter() - start)
        crop_to(dcache, context)
    t, d = statistics.median(times["target"]), statistics.median(times["draft"])
    return {"target_ms": t * 1e3, "draft_ms": d * 1e3, "draft_cost_c": d / t}


def run(args, command: str = "") -> dict:
    from specdec.model.loading import load_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.work_dir = args.work_dir or str(pathlib.Path(args.out).with_suffix(".work"))
    passages = load_corpus(args.corpus)
    device = resolve_device(args.device)
    loaded = load_model(args.target, str(device), "float32")
    target, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise ValueError(f"target {args.target!r} has no tokenizer: distillation needs one to build prompts")
    tokenizer.padding_side = "left"
    if getattr(target.config, "model_type", "") != "llama":
        raise ValueError(f"target {args.target!r} is a {target.config.model_type!r} model; the feature draft copies a Llama layer")
    eos = target_eos(target, tokenizer)
    t0 = time.perf_counter()
    data = build_data(args, target, tokenizer, passages, eos)
    heldout = build_data(args, target, tokenizer, passages, eos, heldout=True)
    t_data = time.perf_counter() - t0
    vocab = int(target.config.vocab_size)
    kept = kept_vocab(data, args.vocab, vocab, eos)
    layers = args.layers or 1
    draft = init_from_target(target, kept, layers).to(device)
    head = target.get_output_embeddings().weight.detach()[torch.tensor(kept, device=device)]
    t1 = time.perf_counter()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # training only: the data above came from full fp32
    try:
        losses = train(args, draft, head, data)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    t_train = time.perf_counter() - t1
    acc = measure_acceptance(draft, heldout, args.draft_length)
    cost = measure_cost(target, draft)
    report = {"command": command, "method": "feature", "target": args.target, "layers": layers, "kept_vocab": len(kept),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "training_sequences": len(data), "training_positions": int(sum(len(r["tokens"]) - 1 for r in data)),
              "steps": args.steps, "batch": args.batch, "unroll": args.unroll,
              "loss_first": statistics.fmean(losses[:20]) if losses else None,
              "loss_last": statistics.fmean(losses[-20:]) if losses else None,
              "data_seconds": t_data, "train_seconds": t_train, **acc, **cost}
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    save_feature_draft(draft.float().cpu(), args.out, args.target, sorted(eos), dtype, extra={"report": report})
    (pathlib.Path(args.out) / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def evaluate(args) -> dict:
    """Held-out acceptance and cost of a feature draft folder, as stored."""
    from specdec.model.feature_draft import load_feature_draft
    from specdec.model.loading import load_model

    torch.set_num_threads(args.threads)
    args.work_dir = args.work_dir or str(pathlib.Path(args.out).with_suffix(".work"))
    passages = load_corpus(args.corpus)
    loaded = load_model(args.target, "cpu", "float32")
    draft, _meta = load_feature_draft(args.out, "cpu", torch.float32, target_override=args.target)
    eos = target_eos(loaded.model, loaded.tokenizer)
    heldout = build_data(args, loaded.model, loaded.tokenizer, passages, eos, heldout=True)
    return {**measure_acceptance(draft, heldout, args.draft_length), **measure_cost(loaded.model, draft),
            "layers": draft.config.num_hidden_layers, "kept_vocab": len(draft.kept_ids), "method": "feature"}
