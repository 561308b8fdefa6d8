#!/usr/bin/env bash
# The main job: draft + target + coordinator on loopback with the embedded default models, then
# generate text and check it token for token against the target decoding alone.
# Without an argument it runs two prompts: a chat question, where the default n-gram drafter finds
# little to copy and the adaptive policy mostly leaves the target alone (about 1x), and a rewrite of
# a paragraph given in the prompt, where it drafts from the input (about 2x on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
    PROMPTS=("$1")
else
    PROMPTS=("Explain in two sentences why the sky is blue."
             "$(.venv/bin/python -c 'import json, sys; print(next(json.loads(l) for l in open(sys.argv[1]) if "rewrite" in l)["messages"][0]["content"])' specdec_tools/prompts/grounded.jsonl)")
fi
PORT=${SPECDEC_DEMO_PORT:-50051}
.venv/bin/specdec up --port "$PORT" 2> >(grep --line-buffered -v '^{' >&2) &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for PROMPT in "${PROMPTS[@]}"; do
    printf '\n>>> %s\n\n' "$PROMPT"
    .venv/bin/specdec generate --address "127.0.0.1:$PORT" --wait 600 --max-new-tokens 160 --compare "$PROMPT"
done
