#!/usr/bin/env bash
# The ours-auto row of the bcacd53 compare run again (its policy: policy-1x16.json; that table
# is in git at 35695de), same flags, on the code with the
# merged decode step (commit 7246204); run alone. Writes ours-auto.json and run.log here.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=runs/compare/opt-6.7b-p512-g32/merged-decode
{ echo "commit $(git rev-parse --short HEAD), load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%FT%TZ)"
  flexgen-helm bench --model facebook/opt-6.7b --dummy --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 32 \
    --gpu-mem 1.5GiB --cpu-mem 4GiB --offload-dir /tmp/flexgen-helm-compare/offload \
    --policy $here/policy-1x16.json --warmup 0 \
    --label 'ours, --policy auto (searched), merged decode' --json $here/ours-auto.json 2>&1 | tr '\r' '\n' | grep -av "step/s\]\|it/s\]\|tensor/s\]"
  echo "load after $(cut -d' ' -f1-3 /proc/loadavg)"; } > $here/run.log
