#!/usr/bin/env bash
# What the disk share of the cache costs a decode step: the plan `--policy auto` chose in
# runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_midnight (gbs 8 x 4, cache 36/5/59, activations
# 0/88/12) against the same plan with that cache and those activations in RAM
# (midnight_plan_cache_in_ram.policy.json: 5.05 GiB of RAM, over the setup's 4 GiB budget), rounds
# alternating, OLMoE-1B-7B cut to 8 blocks, with runs/bench/moe_decode_step/phase_parts.py's timers.
# Run alone: bash runs/bench/disk_cache_in_place/disk_share_ab.sh > runs/bench/disk_cache_in_place/disk_share_ab_<date>.txt
cd "$(dirname "$0")/../../.."
DISK=runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_midnight/olmoe-1b-7b-p512-g32/ours-4bit.policy.json
RAM=runs/bench/disk_cache_in_place/midnight_plan_cache_in_ram.policy.json
echo "# $(python -c 'from flexgen_helm.memory.machine import machine_label; print(machine_label())'), commit $(git rev-parse --short HEAD)"
for round in 1 2 3; do
  for pol in $DISK $RAM; do
    echo "== round $round $pol start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    LAYERS=8 timeout 600 python runs/bench/moe_decode_step/phase_parts.py bench --model allenai/olmoe-1b-7b-0924 \
      --dummy --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 32 --policy $pol --warmup 0 --quiet 2>&1 \
      | tr '\r' '\n' | grep -E "^policy|^prefill:|^decode:|a decode step|decode.int4|decode.attend|decode.expert_mlp"
  done
done
echo "end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
