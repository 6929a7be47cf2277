#!/bin/bash
# A/B of a decode step with the weights and the KV cache on disk (OPT-1.3B dummy, bf16, block 16 x 4,
# prompt 128, 8 generated): before = the cache lane unpacks (git worktree at /work/ab_before, d826fcc),
# after = the compute thread unpacks (the checkout at /work/main). Alternating rounds, alone.
set -u
out=${OUT:-/tmp/cache_lane}  # copied here afterwards
mkdir -p $out
for round in 1 2; do
  for side in before after; do
    dir=/work/$side; [ $side = after ] && dir=/work/main; [ $side = before ] && dir=/work/ab_before
    echo "$side round $round start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> $out/log.txt
    (cd $dir && PYTHONPATH=$dir python -m flexgen_helm bench --model facebook/opt-1.3b --dummy --dtype bfloat16 \
      --prompt-len 128 --gen-len 8 --gpu-batch-size 16 --num-gpu-batches 4 --percent 0 0 0 0 100 0 --quiet \
      --json $out/$side-$round.json > $out/$side-$round.txt 2>&1)
    echo "$side round $round rc=$? end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> $out/log.txt
  done
done
