#!/usr/bin/env bash
# `specdec loadtest` with an older commit and with this tree, alternately, round by round: on a shared
# machine that drifts by 10-20% within minutes, only runs taken side by side compare. The older commit
# runs from a git worktree (PYTHONPATH= that tree) with this checkout's virtual environment.
#
#   bash benchmarks/ab_loadtest.sh BASE_REV ROUNDS OUT [loadtest flags...]
#   bash benchmarks/ab_loadtest.sh ea41927 4 /tmp/ab --weights gguf-a8 --concurrency 8 --num-requests 48 \
#       --max-new-tokens 64 --prompts grounded --speculation both --repeats 1
#
# Writes OUT/base-N/ and OUT/new-N/ (each a loadtest --out folder) and prints, per side, every run's
# tok/s and TTFT / E2EL percentiles, and the mean TTFT of the requests by prompt (index modulo the
# number of prompts): which prompts wait.
set -euo pipefail
base_rev=$1 rounds=$2 out=$3
shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$here/.venv}
tree=$(mktemp -d /tmp/specdec-base.XXXXXX)
git -C "$here" worktree add -f --detach "$tree" "$base_rev" > /dev/null
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in base new; do
    dir=$here
    [ "$side" = base ] && dir=$tree
    (cd "$dir" && PYTHONPATH=$dir "$venv/bin/specdec" loadtest "$@" --out "$out/$side-$round" > "$out/$side-$round.log" 2>&1)
    echo "$side $round done"
  done
done
"$venv/bin/python" - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
for side in ("base", "new"):
    reports = [json.load(open(path)) for path in sorted(glob.glob(f"{out}/{side}-*/loadtest.json"))]
    runs = [run for report in reports for run in report["runs"]]
    if not runs:
        continue
    print(f"{side}: {len(runs)} runs")
    for run in runs:
        print(f"  speculation {'on ' if run['speculation'] else 'off'} {run['output_throughput']:6.1f} tok/s  "
              f"TTFT p50/p99 {run['median_ttft_ms'] / 1e3:.1f}/{run['p99_ttft_ms'] / 1e3:.1f} s  "
              f"E2EL p50/p99 {run['median_e2el_ms'] / 1e3:.1f}/{run['p99_e2el_ms'] / 1e3:.1f} s  identical {run.get('identical', 'unchecked')}")
    prompts = reports[0]["config"]["num_prompts"]  # request i sends prompt i % num_prompts
    by = {}
    for run in runs:
        for q in run["requests"]:
            by.setdefault(q["index"] % prompts, []).append(q["ttft_ms"] / 1e3)
    every = [t for v in by.values() for t in v]
    print(f"  mean tok/s {statistics.mean(r['output_throughput'] for r in runs):.1f}; mean TTFT {statistics.mean(every):.2f} s; by prompt: "
          + " ".join(f"{k}:{statistics.mean(v):.1f}" for k, v in sorted(by.items())))
PY
