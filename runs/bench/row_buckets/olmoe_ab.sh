#!/bin/bash
# OLMoE-1B-7B's geometry cut to LAYERS blocks (4-bit dummy weights in RAM, block 8 x 2, prompt 512,
# 4 new tokens): the experts' row padding of two checkouts alternating (OLD: a worktree of the
# commit before; NEW: this one), each run with ONEDNN_VERBOSE=profile_create, so its kernel
# builds are counted and summed beside its prefill seconds.
#   OLD=/work/wt-old ROUNDS=3 LAYERS=4 bash runs/bench/row_buckets/olmoe_ab.sh > runs/bench/row_buckets/olmoe_ab_<date>.txt
set -e
NEW=$(pwd)
P=runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_sustained_profile/d_block16_652e616/ours-4bit.policy.json
echo "# host: $(lscpu | grep 'Model name' | sed 's/ \+/ /g'), $(nproc) cores; OLD=$(git -C "$OLD" rev-parse --short HEAD) NEW=$(git rev-parse --short HEAD)+working tree; LAYERS=${LAYERS:-4}"
for r in $(seq 1 "${ROUNDS:-3}"); do
  for side in old new; do
    if [ $side = old ]; then tree=$OLD; else tree=$NEW; fi
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=$(cd "$tree" && ONEDNN_VERBOSE=profile_create PYTHONPATH="$tree" LAYERS=${LAYERS:-4} python "$NEW/runs/bench/moe_decode_step/phase_parts.py" bench \
      --model allenai/olmoe-1b-7b-0924 --dummy --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 4 \
      --gpu-mem 1.5GiB --cpu-mem 4GiB --policy "$NEW/$P" --warmup 0 --quiet 2>&1)
    builds=$(echo "$out" | awk -F, '/create:cache_miss/ {n++; s+=$NF} END {printf "%d kernel builds, %.0f ms", n, s}')
    echo "round $r $side load $load: $(echo "$out" | grep '^prefill:') | $(echo "$out" | grep "^prefill.experts' products" | sed 's/ \+/ /g') | $builds"
  done
done
