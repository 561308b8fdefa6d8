#!/bin/bash
# A/B: the OpenMP if clause (main) against the kernels before it (/tmp/wt-ab), tiny target, 64 streams
cd /work/main
for round in 1 2; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/tmp/wt-ab
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m specdec_tools.cli loadtest --target-model /tmp/tiny --prompts chat \
      --max-new-tokens 64 --num-requests 128 --concurrency 64 --speculation off --no-check --out /tmp/ab/$side-$round > /tmp/ab/$side-$round.log 2>&1)
    echo "$side round $round: $(grep -E '^fp32 ' /tmp/ab/$side-$round.log | head -1)"
  done
done
