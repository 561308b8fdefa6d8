#!/usr/bin/env bash
# The GPU evidence of docs/benchmarks.md in one call on a CUDA host (Python 3.12 with torch; nothing
# reachable): `make gpu-check` there, from a working tree carried with .gpu/ (made here by
# `bash benchmarks/cuda_bundle.sh`: wheels the host lacks, SmolLM2's tokenizer, the commit).
# Bounded to fit one device call: the steps' limits add to 460 s, plus the wheels' install (on an
# H200 of 2026-11-28 steps 1-4 took 40, ~150 with twice the tokens and repeats, 110 and 64 s). Each step runs on however the one before
# it ended; the results and labels are written whatever happened.
#   1. tests/test_static.py on CUDA: greedy speculation == decoding alone bit for bit (bf16/fp16/fp32),
#      logits against an fp32 reference within the test's stated tolerance
#   2. benchmarks/cuda_step.py: decode tok/s (HF generate eager and static-cache, --numerics fast,
#      exact), pass costs 1-16 positions, 8 sequences x 4 drafts, profiles (fast, exact without graph)
#   3. specdec bench --device cuda (chat and grounded, n-gram drafter, gRPC rows, a tree row)
#   4. specdec loadtest --device cuda at 1, 8, 32 and 64 streams, speculation on and off, identity checked
#   5. the 64-stream level again with --stream-interval 4 (the serving path's messages a token / 4)
# Models: SmolLM2-135M's shape (and Llama-3.2-1B's in step 2) with seeded random weights, bf16 (the
# GPU default; --dtype auto). Everything goes to $OUT (or /tmp/out) as gpu-check.tar.gz (a device call
# returns 8 files), with labels.json (commit, device, dtype, each step's seconds and exit status) and
# env.txt beside it. STEPS=13 runs steps 1 and 3 only.
set -uo pipefail
bundle=${BUNDLE:-.gpu}; out=${OUT:-/tmp/out}; o=/tmp/gpu-check; steps=${STEPS:-12345}
rm -rf "$o"; mkdir -p "$o" "$out"
[[ -d $bundle/whl && -d $bundle/tokenizer ]] || { echo "cuda_check.sh: no $bundle/whl or $bundle/tokenizer: run benchmarks/cuda_bundle.sh here and carry $bundle" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/whl/*.whl \
  || { echo "cuda_check.sh: installing $bundle/whl failed" >&2; exit 2; }
rm -rf /tmp/site/huggingface_hub /tmp/site/huggingface_hub-*  # the host's own hub matches its httpx
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECDEC_COORDINATOR_HTTP_PORT=-1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__)"
  echo "commit $(cat "$bundle/commit" 2>/dev/null || echo unknown)"; date -u; } 2>&1 | tee "$o/env.txt"
status="{}"
step() {  # step NAME SECONDS COMMAND...: run under a limit, log to $o/NAME.txt, record seconds and exit status
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  echo "== $name (limit $limit s)"
  timeout "$limit" "$@" > "$o/$name.txt" 2>&1; local rc=$?
  status=$(python3 -c "import json,sys; d=json.loads(sys.argv[1]); d[sys.argv[2]]={'rc': int(sys.argv[3]), 'seconds': int(sys.argv[4])}; print(json.dumps(d))" \
           "$status" "$name" "$rc" "$((SECONDS - t0))")
  echo "   exit $rc after $((SECONDS - t0)) s"
}

[[ $steps == *1* ]] && { step pytest 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_static.py; tail -15 "$o/pytest.txt"; }
[[ $steps == *2* ]] && { step step 140 python3 benchmarks/cuda_step.py --device cuda --tokens 64 --repeats 10 --out "$o"; grep '^{' "$o/step.txt"; }
if [[ $steps == *3* || $steps == *4* || $steps == *5* ]]; then  # SmolLM2's shape, seeded random weights, its tokenizer
python3 - "$bundle/tokenizer" <<'PY'
import shutil, sys, pathlib, torch
from transformers import LlamaConfig, LlamaForCausalLM
src, out = pathlib.Path(sys.argv[1]), pathlib.Path("/tmp/rs")
config = LlamaConfig.from_pretrained(src)
torch.manual_seed(0)
LlamaForCausalLM(config).eval().save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
PY
fi
[[ $steps == *3* ]] && { step bench 130 python3 -m specdec_tools.cli bench --device cuda --target-model /tmp/rs --drafter ngram \
  --prompts chat,grounded --limit 3 --max-new-tokens 64 --repeats 1 --draft-lengths 4 --tree-budgets 8 --no-staged --no-llamacpp \
  --out "$o/bench"; grep -v "sequence started\|^{\|^rep \|Loading weights" "$o/bench.txt" | tail -40; }
[[ $steps == *4* ]] && { step loadtest 90 python3 -m specdec_tools.cli loadtest --device cuda --target-model /tmp/rs \
  --concurrency 1,8,32,64 --num-requests 64 --max-new-tokens 64 --prompts chat --speculation both \
  --max-concurrent-requests 64 --max-queue 128 --out "$o/lt"; \
  grep -v "sequence started\|^{" "$o/loadtest.txt" | tail -24; }
[[ $steps == *5* ]] && { step bursts 40 python3 -m specdec_tools.cli loadtest --device cuda --target-model /tmp/rs \
  --concurrency 64 --num-requests 128 --max-new-tokens 64 --prompts chat --speculation off \
  --max-concurrent-requests 64 --max-queue 128 --coordinator-flags "--stream-interval 4" --out "$o/bursts"; \
  grep -v "sequence started\|^{" "$o/bursts.txt" | tail -4; }

python3 - "$o" "$bundle" "$status" <<'PY'
import json, pathlib, sys, torch
o, bundle, status = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), json.loads(sys.argv[3])
bench = o / "bench" / "results.json"
held = json.loads(bench.read_text()).get("weights", {}) if bench.exists() else {}
labels = {"commit": (bundle / "commit").read_text().strip() if (bundle / "commit").exists() else "unknown",
          "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", "torch": torch.__version__,
          "model": "SmolLM2-135M shape (step 2: also Llama-3.2-1B shape), seeded random weights",
          "dtype": {"bench": {k: v.get("dtype") for k, v in held.items()}, "step": "bfloat16", "tests": "bf16, fp16, fp32"},
          "steps": status}
(o / "labels.json").write_text(json.dumps(labels, indent=1))
print(json.dumps(labels))
PY
find /tmp -maxdepth 3 -path '/tmp/specdec-*' -name '*.log' -exec tail -n 25 {} + > "$o/service-logs-tail.txt" 2>/dev/null
rm -f "$o"/bench/*.png "$o"/lt/*.png "$o"/bursts/*.png  # plots: made again from the JSON here
tar czf "$out/gpu-check.tar.gz" -C "$o" . && cp "$o/labels.json" "$o/env.txt" "$out/" && ls -l "$out"
