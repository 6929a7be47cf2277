#!/usr/bin/env bash
# A decode step with a 4-bit KV cache, and where its time goes (issue 17): OPT-1.3B, dummy weights,
# prompt 512, 8 generated tokens, block 4 x 2, cache and weights in compute memory (this CPU-only
# machine's "gpu" tier: RAM), bfloat16. Rows: the cache uncompressed (read in place), 4-bit per token
# (FlexGen's grouping), 4-bit KIVI (the default). Each row is one `flexgen-helm bench`, whose JSON
# holds the per-stage breakdown and whose printout ends with a decode step's breakdown.
# THREADS (default: torch's own choice) sets OMP_NUM_THREADS; on a shared, oversubscribed machine one
# thread avoids the spinning of torch's parallel regions that otherwise dominates small ops.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=runs/bench/compression/kv4_decode
if [[ -n "${THREADS:-}" ]]; then export OMP_NUM_THREADS=$THREADS; fi
bench() {
  local label=$1; shift
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $label "* ]]; then return 0; fi
  echo "== $label (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  flexgen-helm bench --model facebook/opt-1.3b --dummy --prompt-len 512 --gen-len 8 --warmup 0 \
    --gpu-batch-size 4 --num-gpu-batches 2 --label "$label" --json "$out/$label.json" "$@" | tee "$out/$label.txt"
}
bench kv16                                             # the cache in place: nothing to load
bench kv4-per-token --compress-cache --cache-grouping per-token
bench kv4-kivi      --compress-cache --cache-grouping kivi
