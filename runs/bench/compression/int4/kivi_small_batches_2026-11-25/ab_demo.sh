#!/bin/bash
# The README's main job (`flexgen-helm demo -m 10`) from empty HELM caches: before (a worktree of
# 4bd596d at /work/ab_before) against after (the checkout at /work/main), alternating; run alone.
# Each run's runs/demo/helm_runs.csv is copied to $out/{before,after}-N.csv.
set -u
out=${OUT:-/tmp/ab_demo}
mkdir -p "$out"
for round in 1 2; do
  for side in before after; do
    dir=/work/ab_before; [ $side = after ] && dir=/work/main
    cd $dir || exit 1
    rm -rf prod_env/cache benchmark_output/runs/demo
    echo "$side round $round start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> "$out/log.txt"
    s=$(date +%s.%N)
    PYTHONPATH=$dir python -m flexgen_helm demo -m 10 > "$out/$side-$round.log" 2>&1
    rc=$?
    e=$(date +%s.%N)
    echo "$side round $round rc=$rc wall $(echo "$e - $s" | bc) s end load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/log.txt"
    cp runs/demo/helm_runs.csv "$out/$side-$round.csv"
    git checkout -q runs/demo 2>/dev/null
  done
done
