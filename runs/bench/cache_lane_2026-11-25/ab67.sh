#!/bin/bash
# The same A/B at OPT-6.7B scale: the policy the search chose for 128/128 (runs/compare/opt-6.7b-p128-g128:
# block 4 x 32, weights on disk, cache 23% RAM / 77% disk), prompt 128, 8 generated, one round each, alone.
set -u
out=${OUT:-/tmp/cache_lane67}  # copied to opt67/ afterwards
mkdir -p $out
policy=/work/main/runs/compare/opt-6.7b-p128-g128/ours-auto.policy.json
for side in before after; do
  dir=/work/main; [ $side = before ] && dir=/work/ab_before
  echo "$side start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> $out/log.txt
  (cd $dir && PYTHONPATH=$dir python -m flexgen_helm bench --model facebook/opt-6.7b --dummy --dtype bfloat16 \
    --device cpu --prompt-len 128 --gen-len 8 --gpu-mem 1.5GiB --cpu-mem 4GiB --offload-dir $out/offload \
    --policy $policy --warmup 0 --quiet --json $out/$side-67.json > $out/$side-67.txt 2>&1)
  echo "$side rc=$? end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> $out/log.txt
done
