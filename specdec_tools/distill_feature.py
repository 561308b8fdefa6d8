"""`specdec distill --method feature`: train a feature draft (specdec/model/feature_draft.py) for a target, on CPU.

Stages, each cached under --work-dir so a killed run resumes:
- data: the target's greedy continuations of chat prompts (the states the draft meets when it
  drafts for this target), and the target's final hidden states at every position of prompt and
  continuation (one plain prefill per sequence: exact, and cheap next to generation).
- vocab: the head keeps the N most frequent tokens of that data (eos always).
- train: at each position i the draft sees (f_i, x_{i+1}) and must predict f_{i+1}: cross-entropy
  against the target's own distribution there (its head on f_{i+1}, over the kept vocabulary) plus
  a smooth-L1 pull towards f_{i+1} itself. `--unroll N` trains N passes, pass k being the k-th
  drafted token of every chain (EAGLE-3's training-time test): it sees the predicted features and
  attends to the true pairs and its own chain's, exactly as drafting does (unroll_mask).
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
from specdec.model.features import layer_outputs, resolve_feature_layers
from specdec.model.loading import resolve_device


@torch.inference_mode()
def generate_with_features(model, tokenizer, prompts: list[list[int]], max_new: int, eos: set[int],
                           batched: bool | None = None, layers: tuple[int, ...] = ()) -> list[dict]:
    """Greedy continuations of a left-padded batch, then each row's final hidden states [L, H]
    ("feat") and, with `layers`, those layers' outputs concatenated [L, len(layers) * H] ("fused").

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
    with layer_outputs(model.model, layers) as captured:
        if not (device.type != "cpu" if batched is None else batched):
            feats = [model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0] for tokens in sequences]
            fused = [torch.cat([captured[layer][row][0] for layer in layers], dim=-1) for row in range(len(sequences))] if layers else []
        else:
            longest = max(map(len, sequences))
            padded = torch.tensor([t + [pad] * (longest - len(t)) for t in sequences], device=device)
            hidden = model.model(input_ids=padded).last_hidden_state.to(torch.float16).cpu()
            feats = [hidden[row, : len(t)] for row, t in enumerate(sequences)]
            if layers:
                joined = torch.cat([captured[layer][0] for layer in layers], dim=-1).to(torch.float16).cpu()
                fused = [joined[row, : len(t)] for row, t in enumerate(sequences)]
    records = [{"tokens": torch.tensor(tokens, dtype=torch.int32), "prompt_len": len(prompt), "feat": f.to(torch.float16).clone()}
               for tokens, prompt, f in zip(sequences, prompts, feats)]
    for record, values in zip(records, fused if layers else []):
        record["fused"] = values.float().clamp(-65504.0, 65504.0).to(torch.float16).clone()  # as the wire carries them
    return records


def build_data(args, model, tokenizer, passages: list[str], eos: set[int], heldout: bool = False) -> list[dict]:
    count = args.heldout_prompts if heldout else args.gen_prompts
    tokens = args.eval_tokens if heldout else args.gen_tokens
    layers = resolve_feature_layers(getattr(args, "feature_layers", ""), model.config.num_hidden_layers)
    settings = {"target": args.target, "corpus": passages, "seed": args.seed, "prompts": count,
                "batch": args.gen_batch, "tokens": tokens, "device": model.device.type}
    work = data_dir(pathlib.Path(args.work_dir) / ("heldout" if heldout else "features"),
                    {**settings, "feature_layers": ",".join(map(str, layers))} if layers else settings)
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
                torch.save(generate_with_features(model, tokenizer, batch, tokens, eos, layers=layers), shard.with_suffix(".tmp"))
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


def make_batch(records: list[dict], max_len: int, rng: random.Random, fused: bool = False) -> tuple[torch.Tensor, ...]:
    """(features [B, T, H], tokens [B, T], mask [B, T-1], sources [B, T, D]) of random windows of at
    most max_len positions; sources are what the draft reads from the target: the fused layers'
    outputs where `fused`, else the features themselves."""
    length = min(max_len, max(len(r["tokens"]) for r in records))
    hidden = records[0]["feat"].shape[1]
    feats = torch.zeros(len(records), length, hidden)
    sources = torch.zeros(len(records), length, records[0]["fused"].shape[1]) if fused else feats
    tokens = torch.zeros(len(records), length, dtype=torch.long)
    mask = torch.zeros(len(records), length - 1)
    for b, r in enumerate(records):
        n = len(r["tokens"])
        s = rng.randint(0, max(0, n - length))
        e = min(n, s + length)
        feats[b, : e - s] = r["feat"][s:e].float()
        if fused:
            sources[b, : e - s] = r["fused"][s:e].float()
        tokens[b, : e - s] = r["tokens"][s:e].long()
        mask[b, : e - s - 1] = 1
    return feats, tokens, mask, sources


def unroll_mask(length: int, depth: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive attention mask [T, (depth+1)T] of unrolled pass `depth` over the keys of passes 0..depth.

    Pair i of pass k stands for the k-th drafted token of a chain that left the true features at
    pair i-k: as in the draft service, it sees the true pairs up to i-k and the chain's own pairs
    after (pass m's pair i-k+m, m = 1..k), never another chain's predictions. This is EAGLE-3's
    training-time test: training sees exactly the inputs drafting sees.
    """
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    allowed = [j <= i - depth] + [j == i - depth + m for m in range(1, depth + 1)]
    mask = torch.zeros(length, (depth + 1) * length, dtype=dtype, device=device)
    return mask.masked_fill(~torch.cat(allowed, dim=1), torch.finfo(dtype).min)


def unrolled(draft: FeatureDraft, inputs: torch.Tensor, following: torch.Tensor, unroll: int):
    """Yields (predicted features, logits) of passes 0..unroll-1 over pairs (inputs[:, i], following[:, i]).

    Pass 0 sees the true features; pass k > 0 is the k-th drafted token of every chain at once:
    pair i sees the prediction of f_i that pass k-1 made at pair i-1, and attends as unroll_mask
    says (the passes share one KV cache). Its pairs i < k belong to no chain: ignore them.
    """
    batch_size, length = following.shape
    positions = torch.arange(length, device=following.device)[None].expand(batch_size, -1)
    cache = draft.new_cache() if unroll > 1 else None
    seen = inputs
    for u in range(unroll):
        x = draft.inputs(seen, following)
        attend = unroll_mask(length, u, x.dtype, x.device)[None, None].expand(batch_size, 1, -1, -1)
        out = draft.body(inputs_embeds=x, attention_mask=attend, position_ids=positions,
                         **cache_kwargs(draft.body, cache), use_cache=cache is not None)
        predicted = out.last_hidden_state
        yield predicted, draft.head(predicted)
        seen = torch.cat([predicted[:, :1], predicted[:, :-1]], dim=1)  # pair i now sees the prediction of f_i


def feature_loss(draft: FeatureDraft, head: torch.Tensor, batch, reg: float, unroll: int) -> tuple[torch.Tensor, float]:
    """Mean over unroll passes (unrolled) of CE(target dist | draft) + reg * smooth-L1(predicted f, true f).

    head [N, H]: the TARGET's output rows of the kept ids, so the soft label is the target's own
    distribution at i+1. Returns the loss and pass 0's argmax agreement with the target.
    """
    feats, tokens, mask, *sources = batch
    inputs = draft.from_target((sources[0] if sources else feats)[:, :-1])
    following, wanted = tokens[:, 1:], feats[:, 1:]
    with torch.no_grad():
        label = torch.softmax(wanted @ head.T, dim=-1)
    total, agreement = 0.0, 0.0
    for u, (predicted, logits) in enumerate(unrolled(draft, inputs, following, unroll)):
        m = mask.clone()
        m[:, :u] = 0  # pass u has no chain to stand on for its first u positions
        ce = -(torch.log_softmax(logits, dim=-1) * label).sum(-1)
        l1 = torch.nn.functional.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
        total = total + ((ce + reg * l1) * m).sum() / m.sum().clamp(min=1)
        if u == 0:
            agreement = float(((logits.argmax(-1) == label.argmax(-1)).float() * m).sum() / m.sum().clamp(min=1))
    return total / unroll, agreement


def train(args, draft: FeatureDraft, head: torch.Tensor, data: list[dict]) -> list[float]:
    """distill_training.train_loop over random windows of the data; the progress bar also shows agreement."""
    agreements: list[float] = []

    device = next(draft.fc.parameters()).device
    head = head.to(device)

    def loss_of(chosen: list[int], rng: random.Random):
        batch = [t.to(device, non_blocking=True)
                 for t in make_batch([data[i] for i in chosen], args.seq_len, rng, fused=draft.fuse is not None)]
        loss, agreement = feature_loss(draft, head, batch, args.reg, args.unroll)
        agreements.append(agreement)
        return loss, f", agreement {statistics.fmean(agreements[-20:]):.3f}"

    return train_loop(args, draft, len(data), loss_of, pathlib.Path(args.work_dir) / "feature_checkpoint.pt",
                      "training the feature draft", lambda key: not key.startswith("embed."))


@torch.inference_mode()
def chain_hits(draft: FeatureDraft, record: dict, g: int, depths: list[list[int]] | None = None) -> tuple[int, int, int]:
    """(steps, drafted, accepted) of greedy speculation over one held-out record, drafting as the
    draft service does: true features up to the last verified position, its own predictions after.

    depths, if given ([[reached, accepted]] * g), counts per draft position j how often a step drafted
    there (its first j tokens accepted) and how often the target took it: position j > 0 drafts from
    j predicted features, which is what training with --unroll is for."""
    device = draft.kept_ids.device
    tokens, start = record["tokens"].long().to(device), record["prompt_len"]
    feats = draft.from_target(record["fused" if draft.feature_layers else "feat"].float().to(device))  # what the target sends
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
            if depths is not None:
                depths[j][0] += 1
            if guess != int(tokens[pos + j]):
                break
            if depths is not None:
                depths[j][1] += 1
            k, token = k + 1, torch.tensor([[guess]], device=device)
        steps, drafted, accepted = steps + 1, drafted + width, accepted + k
        crop_to(cache, kept)
        after = min(n, pos + k + 1)
        draft(feats[None, pos - 2: after - 2], tokens[None, pos - 1: after - 1], cache, use_cache=True)  # the true pairs
        pos = after
    return steps, drafted, accepted


def measure_acceptance(draft: FeatureDraft, heldout: list[dict], g: int) -> dict:
    steps = drafted = accepted = positions = 0
    depths = [[0, 0] for _ in range(g)]
    for record in heldout:
        s, d, a = chain_hits(draft, record, g, depths)
        steps, drafted, accepted = steps + s, drafted + d, accepted + a
        positions += len(record["tokens"]) - record["prompt_len"]
    one = [chain_hits(draft, r, 1) for r in heldout]
    return {"prompts": len(heldout), "draft_length": g, "target_tokens": positions, "acceptance": accepted / max(drafted, 1),
            "accepted_per_step": accepted / max(steps, 1), "tokens_per_target_pass": positions / max(steps, 1),
            "per_token_agreement": sum(a for _, _, a in one) / max(sum(d for _, d, _ in one), 1),
            # at each draft position, the share the target took of the tokens drafted there
            "agreement_by_position": [a / r if r else None for r, a in depths]}


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
    feature_layers = resolve_feature_layers(args.feature_layers, target.config.num_hidden_layers)
    rms = float(torch.cat([r["fused"][:, -target.config.hidden_size:].float() for r in data]).pow(2).mean().sqrt()) if feature_layers else 1.0
    draft = init_from_target(target, kept, layers, feature_layers, rms).to(device)
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
              "feature_layers": list(feature_layers),
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
    args.feature_layers = ",".join(map(str, draft.feature_layers))  # the held-out data carries what the draft reads
    weights = getattr(args, "weights", "fp32")
    if weights != "fp32":  # the draft as the draft service serves it in that format
        from specdec.model.cpu import gemm

        gemm.apply(draft, torch.device("cpu"), torch.float32, gemm.DEFAULT_ROWS, 1, weights, None)
    eos = target_eos(loaded.model, loaded.tokenizer)
    heldout = build_data(args, loaded.model, loaded.tokenizer, passages, eos, heldout=True)
    return {**measure_acceptance(draft, heldout, args.draft_length), **measure_cost(loaded.model, draft),
            "layers": draft.config.num_hidden_layers, "kept_vocab": len(draft.kept_ids), "method": "feature",
            "weights": weights}
