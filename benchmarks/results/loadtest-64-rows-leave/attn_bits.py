"""Logits of small random Llamas whose head sizes take attend_row (16, 32, 48, 80, 96, 24), int8 weights,
one prompt fed whole and then 5 steps: saved to argv[1] or compared with it."""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from specdec.model.cpu import gemm
from specdec.model.gpu.static import exact_lm
from specdec.kv.store import Sequence
torch.set_num_threads(2)
out = {}
for D in (16, 32, 48, 80, 96, 24):
    torch.manual_seed(D)
    cfg = LlamaConfig(vocab_size=300, hidden_size=4 * D, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=D, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    gemm.apply(model, torch.device("cpu"), torch.float32, gemm.DEFAULT_ROWS, gemm.DEFAULT_MIN_ROWS, "int8", None)
    lm = exact_lm(model, torch.device("cpu"))
    seq = Sequence("s", [int(t) for t in torch.randint(0, 300, (40,))])
    logs = [lm.forward(seq, keep=40)]
    for _ in range(5):
        seq.tokens.append(int(logs[-1][-1].argmax()))
        logs.append(lm.forward(seq, keep=1))
    out[D] = torch.cat(logs)
if sys.argv[2] == "save":
    torch.save(out, sys.argv[1])
else:
    ref = torch.load(sys.argv[1])
    for D in out:
        print(D, "identical" if torch.equal(out[D], ref[D]) else f"DIFFERS max {float((out[D]-ref[D]).abs().max())}")
