#!/bin/bash
# The README's main job (`flexgen-helm demo -m 10`) from empty HELM caches, BEFORE against AFTER
# (commits, each run from a worktree of its own: /work/ab_before, /work/ab_after), alternating,
# ROUNDS rounds; run alone. Each run's runs/demo/helm_runs.csv is copied to $OUT/{before,after}-N.csv
# and its load averages and wall time to $OUT/log.txt.
#   BEFORE=936593c AFTER=<commit> ROUNDS=3 OUT=<folder> bash ab_demo.sh
set -u
out=${OUT:?}; mkdir -p "$out"
for side in before after; do
  commit=$BEFORE; [ $side = after ] && commit=$AFTER
  git -C /work/main worktree add -q --detach /work/ab_$side "$commit" || exit 1
done
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in before after; do
    cd /work/ab_$side || exit 1
    rm -rf prod_env/cache benchmark_output/runs/demo
    echo "$side round $round start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> "$out/log.txt"
    s=$(date +%s.%N)
    PYTHONPATH=/work/ab_$side python -m flexgen_helm demo -m 10 > "$out/$side-$round.log" 2>&1
    rc=$?
    e=$(date +%s.%N)
    echo "$side round $round rc=$rc wall $(echo "$e - $s" | bc) s end load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/log.txt"
    cp runs/demo/helm_runs.csv "$out/$side-$round.csv"
  done
done
for side in before after; do git -C /work/main worktree remove --force /work/ab_$side; done
