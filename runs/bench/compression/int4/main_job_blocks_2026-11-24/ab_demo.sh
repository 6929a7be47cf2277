#!/bin/bash
# A/B of the README's main job: before (40af64e) vs after (HEAD of /work/main), alternating, from empty HELM caches.
# Setup: git worktree add --detach /work/before 40af64e (the "before"); the "after" is the checkout at /work/main (ddad695 for first_cut_ddad695/, a54b5d6 for final/).
set -u
out=/tmp/ab
for round in 1 2 3; do
  for side in before after; do
    dir=/work/$side; [ $side = after ] && dir=/work/main
    cd $dir
    rm -rf prod_env/cache benchmark_output/runs/demo
    echo "$side round $round start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> $out/log.txt
    s=$(date +%s.%N)
    PYTHONPATH=$dir python -m flexgen_helm demo -m 10 > $out/$side-$round.log 2>&1
    e=$(date +%s.%N)
    echo "$side round $round rc=$? wall $(echo "$e - $s" | bc) s end load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log.txt
    cp runs/demo/helm_runs.csv $out/$side-$round.csv
    git checkout -q runs/demo 2>/dev/null
  done
done
