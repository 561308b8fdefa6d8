import sys, torch
from specdec.model.loading import load_model
from specdec.model.feature_draft import load_feature_draft
from specdec.model.cpu import gemm
from specdec_tools.workload import load_prompt_ids
torch.set_num_threads(1)
loaded = load_model("smollm2-135m-instruct", "cpu", "float32")
prompts = load_prompt_ids(loaded.tokenizer, "grounded", 4) + load_prompt_ids(loaded.tokenizer, "chat", 8)
ref, _ = load_feature_draft("specdec/drafts/smollm2-135m-feature", "cpu", torch.float32)
fmts = sys.argv[1].split(",")
drafts = {}
for f in fmts:
    d, _ = load_feature_draft("specdec/drafts/smollm2-135m-feature", "cpu", torch.float32)
    gemm.apply(d, torch.device("cpu"), torch.float32, gemm.DEFAULT_ROWS, 1, f, None); drafts[f] = d
same = {f: 0 for f in fmts}; n = 0; tgt = {f: 0 for f in ["ref", *fmts]}
with torch.inference_mode():
    for p in prompts:
        ids = torch.tensor([p])
        out = loaded.model(input_ids=ids, output_hidden_states=True)
        feats = out.hidden_states[-1]  # post-norm final hidden states
        tnext = out.logits[0].argmax(-1)  # target's next token at each position
        # pairs (f_i, x_{i+1}) -> predicts token i+2
        f_in, x_in = feats[:, :-1], ids[:, 1:]
        r = ref.kept_ids[ref(f_in, x_in)[1][0].argmax(-1)]
        truth = tnext[1:]
        tgt["ref"] += int((r == truth).sum())
        for f, d in drafts.items():
            c = d.kept_ids[d(f_in, x_in)[1][0].argmax(-1)]
            same[f] += int((c == r).sum()); tgt[f] += int((c == truth).sum())
        n += r.numel()
print("positions", n, {f: round(same[f] / n, 4) for f in fmts}, "target agreement", {k: round(v / n, 4) for k, v in tgt.items()})
