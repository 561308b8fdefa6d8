#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md, in one run on a CUDA host with Python 3.12 and torch.
#   bash benchmarks/cuda_check.sh [WHEELS_DIR] [TOKENIZER_DIR]
# WHEELS_DIR: py3.12 wheels of what the host lacks (../shared/gpu/bundle.sh makes them), installed
# into /tmp/site. TOKENIZER_DIR: SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json,
# config.json), so bench and loadtest can tokenize their prompt sets for a model of SmolLM2's shape
# with seeded random weights (no weights travel). Results go to $OUT (or /tmp/out).
# Steps, most important first, each under its own time limit:
#   1. tests/test_static.py on CUDA: greedy speculation == decoding alone, bit for bit (bf16/fp16/fp32)
#   2. benchmarks/cuda_step.py: decode tok/s (HF generate, --numerics fast, exact), pass costs, profile
#   3. specdec bench --device cuda; 4. specdec loadtest --device cuda (1 and 8 streams, identity checked)
set -u
wheels=${1:-.whl}; tok=${2:-.gpu/tokenizer}; o=${OUT:-/tmp/out}; mkdir -p "$o"
steps=${STEPS:-1234}  # which of the steps below to run
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
  rm -rf /tmp/site/huggingface_hub /tmp/site/huggingface_hub-*
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECDEC_COORDINATOR_HTTP_PORT=-1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__)"
  date -u; } 2>&1 | tee "$o/env.txt"

if [[ $steps == *1* ]]; then echo "== 1. exactness on CUDA"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_static.py 2>&1 | tail -25 | tee "$o/pytest.txt"; fi

if [[ $steps == *2* ]]; then echo "== 2. step costs"
timeout 150 python3 benchmarks/cuda_step.py --device cuda --out /tmp/step 2>&1 | grep -v "sequence started" | tee "$o/step.txt" | grep '^{'; fi

if [[ $steps == *3* ]]; then echo "== 3. bench"
python3 - "$tok" <<'EOF'
import shutil, sys, pathlib, torch
from transformers import LlamaConfig, LlamaForCausalLM
src, out = pathlib.Path(sys.argv[1]), pathlib.Path("/tmp/rs")
config = LlamaConfig.from_pretrained(src)
torch.manual_seed(0)
LlamaForCausalLM(config).eval().save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
EOF
timeout 200 python3 -m specdec_tools.cli bench --device cuda --target-model /tmp/rs --drafter ngram --prompts chat,grounded --limit 4 \
  --max-new-tokens 64 --repeats 2 --draft-lengths 4 --tree-budgets 8 --no-staged --no-llamacpp --out /tmp/bench > "$o/bench.txt" 2>&1
grep -v "sequence started\|^{" "$o/bench.txt" | tail -40; fi

if [[ $steps == *4* ]]; then echo "== 4. loadtest"
timeout 150 python3 -m specdec_tools.cli loadtest --device cuda --target-model /tmp/rs --concurrency 1,8 --num-requests 16 \
  --max-new-tokens 64 --prompts grounded --speculation both --out /tmp/lt > "$o/loadtest.txt" 2>&1
grep -v "sequence started\|^{" "$o/loadtest.txt" | tail -16; fi
cp /tmp/step/profile-smollm2-135m.txt /tmp/bench/results.json "$o/" 2>/dev/null; cp /tmp/lt/loadtest.json "$o/" 2>/dev/null; ls "$o"
