#!/bin/bash
# A/B of `flexgen-helm eval --task lambada --limit 500 --dtype bfloat16` (issue 24's lm-eval row): before (40af64e) vs after.
# Setup: git worktree add --detach /work/before 40af64e (the "before"); the "after" is the checkout at /work/main
# (eval/: ddad695, OUT=/tmp/ab; eval_final/: baf388d, OUT=/tmp/ab4), its records copied here afterwards.
set -u
out=${OUT:-/tmp/ab}
for round in 1 2 3 4 5; do
  for side in before after; do
    dir=/work/$side; [ $side = after ] && dir=/work/main
    cd $dir
    echo "$side round $round start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> $out/eval_log.txt
    PYTHONPATH=$dir python -m flexgen_helm eval --task lambada --limit 500 --dtype bfloat16 --quiet --json $out/eval-$side-$round.json > $out/eval-$side-$round.log 2>&1
    echo "$side round $round rc=$? end load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/eval_log.txt
  done
done
