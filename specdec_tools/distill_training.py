"""The training both distillations share (distill.py, distill_feature.py): the data folder that
refuses shards made with other settings, the progress bar, and the training loop with its
checkpoints.

Apart from distill.py so that distill_feature.py uses them without importing distill.py, which
starts distill_feature.py in turn (no import cycle among the tools).
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import statistics
import time

import torch


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), TimeRemainingColumn())


def data_dir(folder: pathlib.Path, settings: dict) -> pathlib.Path:
    """`folder`, created, holding shards made with exactly `settings` (written to settings.json).

    Shards are cached by batch index, so shards made with other settings (another --gen-tokens,
    batch size, corpus or target) would be reused silently and mixed with new ones. A folder
    with other settings is refused with the differences named, never overwritten: it may hold
    hours of generation.
    """
    import hashlib

    settings = {k: (hashlib.sha256("\n\n".join(v).encode()).hexdigest()[:16] if isinstance(v, list) else v)
                for k, v in settings.items()}  # a corpus enters as the hash of its passages
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "settings.json"
    if record.exists():
        held = json.loads(record.read_text())
        diff = {k: (held.get(k), settings.get(k)) for k in sorted(set(held) | set(settings)) if held.get(k) != settings.get(k)}
        if diff:
            named = ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in diff.items())
            raise ValueError(f"{folder} holds data made with other settings ({named}); "
                             "pass another --work-dir, or delete that folder to regenerate")
    elif any(folder.glob("shard_*.pt")):
        raise ValueError(f"{folder} holds shards with no record of their settings; "
                         "pass another --work-dir, or delete that folder to regenerate")
    else:
        record.write_text(json.dumps(settings, indent=1, sort_keys=True))
    return folder


def train_loop(args, model: torch.nn.Module, count: int, loss_of, ckpt: pathlib.Path, title: str, stored) -> list[float]:
    """The training loop both methods share: seeded shuffled batches of `count` examples, AdamW with
    warm-up and cosine decay, gradient clipping, a checkpoint every --checkpoint-every steps.

    loss_of(indices, rng) -> (loss, progress note); it may draw from rng (the same generator as the
    batch order, so an unbroken run is a function of --seed). stored(key): which state-dict entries
    the checkpoint keeps (not the target's shared embedding). A run finds its checkpoint and goes
    on from it, replaying the batch order so it trains on what an unbroken run would.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    step, losses = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, losses = state["step"], state["losses"]
    rng = random.Random(args.seed)
    order: list[int] = []

    def next_batch() -> list[int]:
        nonlocal order
        if len(order) < args.batch:
            order = list(range(count))
            rng.shuffle(order)
        chosen, order = order[: args.batch], order[args.batch:]
        return chosen

    for _ in range(step):
        next_batch()

    def lr_at(s: int) -> float:
        warm = max(1, args.steps // 20)
        return args.lr * min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))

    model.train()
    budget, began, first = getattr(args, "train_budget_s", 0.0), time.perf_counter(), step
    with _progress() as progress:
        task = progress.add_task(title, total=args.steps, completed=step, info="")
        while step < args.steps:
            if budget and step - first == 20:
                # Fit the run to the time given: fewer steps, with the schedule decaying over them.
                rate = (time.perf_counter() - began) / 20
                if rate * (args.steps - first) > budget:
                    args.steps = max(step + 1, first + int(budget / rate))
                    progress.update(task, total=args.steps)
            loss, note = loss_of(next_batch(), rng)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            losses.append(loss.item())
            progress.update(task, advance=1, info=f"loss {statistics.fmean(losses[-20:]):.3f}{note}")
            if step % args.checkpoint_every == 0 or step == args.steps:
                kept = {k: v for k, v in model.state_dict().items() if stored(k)}
                torch.save({"model": kept, "opt": opt.state_dict(), "step": step, "losses": losses}, ckpt.with_suffix(".tmp"))
                ckpt.with_suffix(".tmp").rename(ckpt)
    model.eval()
    return losses
