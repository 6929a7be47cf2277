#!/bin/bash
# before (a worktree of 4bd596d at /work/ab_before: git worktree add --detach /work/ab_before 4bd596d)
# against after (the checkout at /work/main), alternating, three rounds; run alone
here=$(cd "$(dirname "$0")" && pwd)
for r in 1 2 3; do
  for side in ab_before main; do
    echo "== $side round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=/work/$side python "$here/slot_micro.py"
    PYTHONPATH=/work/$side python "$here/lambada_engine.py" 3 2>&1 | grep -E "^(round|bf16 /)"
  done
done
