"""Cut a feature draft's head to the N target tokens the target itself says most often.

    .venv/bin/python -m specdec_tools.feature_head --draft smollm2-135m-feature --rows 4096,2048 --out-prefix /tmp/cut

Why: the head is about half of a feature draft's weights and every row is read each drafted token,
while the rows of rare tokens win few positions. The committed draft's folder keeps its head ids in
id order (the training data's counts stayed on the machine that trained it), so the order is
measured again the way training measured it (specdec_tools/distill_feature.py: kept_vocab): the
target's own greedy continuations of training prompts (never the held-out ones), counted over
prompt and continuation, end-of-sequence always kept, ties by token id. Each cut is written as a
draft folder (specdec/model/feature_draft.py: cut_head); `specdec distill --method feature --out CUT
--evaluate` then measures its held-out agreement against the uncut draft's on the same positions.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys


def token_order(args: argparse.Namespace, kept: list[int]) -> tuple[list[int], int]:
    """The draft's kept ids, most frequent in the target's continuations first; and the tokens counted."""
    import torch

    from specdec.model.loading import load_model
    from specdec_tools.distill import load_corpus, target_eos
    from specdec_tools.distill_feature import build_data

    loaded = load_model(args.target, "cpu", "float32")
    loaded.tokenizer.padding_side = "left"
    eos = target_eos(loaded.model, loaded.tokenizer)
    data_args = argparse.Namespace(gen_prompts=args.count_prompts, gen_tokens=args.count_tokens, gen_batch=args.gen_batch,
                                   work_dir=args.work_dir, target=args.target, seed=args.seed, data_budget_s=0.0)
    data = build_data(data_args, loaded.model, loaded.tokenizer, load_corpus(args.corpus), eos)
    counts = torch.zeros(int(loaded.model.config.vocab_size), dtype=torch.float64)
    for record in data:
        counts += torch.bincount(record["tokens"].long(), minlength=counts.numel()).double()
    for t in eos:
        counts[t] = float("inf")
    return sorted(kept, key=lambda t: (-counts[t].item(), t)), int(sum(len(r["tokens"]) for r in data))


def main(argv: list[str] | None = None) -> int:
    import torch

    from specdec.model.feature_draft import cut_head, load_feature_draft, save_feature_draft
    from specdec.model.loading import feature_draft_folder

    parser = argparse.ArgumentParser(prog="python -m specdec_tools.feature_head", description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="smollm2-135m-feature", help="Feature draft: alias or folder.")
    parser.add_argument("--rows", default="4096,2048", help="Head sizes to cut to, comma-separated.")
    parser.add_argument("--out-prefix", required=True, help="Each cut goes to PREFIX-ROWS/.")
    parser.add_argument("--target-model", dest="target", default="", help="The draft's target (default: the one it names).")
    parser.add_argument("--corpus", action="append", default=[], help="As specdec distill's (default: the Debian fortunes).")
    parser.add_argument("--count-prompts", type=int, default=64, help="Training prompts whose continuations are counted.")
    parser.add_argument("--count-tokens", type=int, default=128, help="New tokens per continuation.")
    parser.add_argument("--gen-batch", type=int, default=16)
    parser.add_argument("--work-dir", default="", help="Where the continuations are cached (default: PREFIX.work).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = feature_draft_folder(args.draft) or pathlib.Path(args.draft)
    model, meta = load_feature_draft(folder, "cpu", torch.float32)
    args.target = args.target or meta["target"]
    args.work_dir = args.work_dir or args.out_prefix + ".work"
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    kept = model.kept_ids.tolist()
    if any(not 1 <= r <= len(kept) for r in rows):
        print(f"feature_head: --rows must lie in 1..{len(kept)} (the draft's head)", file=sys.stderr)
        return 2
    order, counted = token_order(args, kept)
    command = "python -m specdec_tools.feature_head " + shlex.join(argv if argv is not None else sys.argv[1:])
    for r in rows:
        out = pathlib.Path(f"{args.out_prefix}-{r}")
        cut = cut_head(model, order[:r])
        extra = {k: v for k, v in meta.items() if k not in ("format", "target", "target_vocab_size", "llama_config", "eos_token_ids")}
        extra["head_cut"] = {"from_rows": len(kept), "rows": r, "counted_tokens": counted, "command": command}
        save_feature_draft(cut, out, meta["target"], meta.get("eos_token_ids", []), torch.bfloat16, extra=extra)
        (out / "head_order.json").write_text(json.dumps(order) + "\n")
        print(f"{out}: {r} of {len(kept)} head rows ({counted} target tokens counted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
