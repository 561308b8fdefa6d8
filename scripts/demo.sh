#!/usr/bin/env bash
# The main job: draft + target + coordinator on loopback with the embedded default models, then
# generate text and check it token for token against the target decoding alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Explain in two sentences why the sky is blue."}
PORT=${SPECDEC_DEMO_PORT:-50051}
.venv/bin/specdec up --port "$PORT" 2> >(grep --line-buffered -v '^{' >&2) &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
.venv/bin/specdec generate --address "127.0.0.1:$PORT" --wait 600 --max-new-tokens 96 --compare "$PROMPT"
