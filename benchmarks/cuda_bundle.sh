#!/usr/bin/env bash
# What a CUDA host needs beside the working tree for benchmarks/cuda_check.sh, made here (where pip
# reaches the package index) into .gpu/ (ignored by git, carried by the device call):
#   .gpu/whl        py3.12 manylinux wheels of the packages such a host's image lacks (pinned to
#                   this venv's versions, no deps)
#   .gpu/tokenizer  SmolLM2's tokenizer and config, no weights (bench and loadtest tokenize their
#                   prompt sets for a model of SmolLM2's shape with seeded random weights)
#   .gpu/commit     the commit the run measures (the device gets a working tree, not the history),
#                   with "-dirty" when the tree differs from it
#   bash benchmarks/cuda_bundle.sh     (then: make gpu-check on the host)
set -euo pipefail
root=$(git rev-parse --show-toplevel); out=$root/.gpu; py=${PYTHON:-$root/.venv/bin/python}
rm -rf "$out"; mkdir -p "$out/whl" "$out/tokenizer"
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=(structlog fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection
      annotated-doc gguf protobuf grpcio grpcio-health-checking grpcio-reflection grpcio-status
      googleapis-common-protos transformers)
spec=(); for p in "${pkgs[@]}"; do spec+=("$p==$(ver "$p")"); done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out/whl" "${spec[@]}"
tok=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/specdec/models/smollm2-135m-instruct-* 2>/dev/null | head -1 || true)
[[ -n "$tok" ]] || { echo "cuda_bundle.sh: no converted SmolLM2 in specdec's cache: run make demo once" >&2; exit 1; }
find "$tok" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$out/tokenizer/" \;
commit=$(git -C "$root" rev-parse --short=12 HEAD)
git -C "$root" diff --quiet HEAD || commit="$commit-dirty"
echo "$commit" > "$out/commit"
du -sh "$out"/whl "$out"/tokenizer; echo "commit $commit"
