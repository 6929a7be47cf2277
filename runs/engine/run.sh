#!/usr/bin/env bash
# Issue 2 benchmarks on a CPU-only machine: OPT-1.3B with dummy weights, prompt 512 / gen 32,
# (a) weights in RAM, (b) weights on disk (read with O_DIRECT), several block shapes.
# No warm-up run (--warmup 0): the prefill warms the engine up before the decode is timed.
# Writes runs/engine/json/*.json and runs/engine/report.md (tables built from those files).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=runs/engine
offload=${OFFLOAD_DIR:-/tmp/flexgen-helm-offload}
mkdir -p "$out/json"
bench() {
  local label=$1; shift
  flexgen-helm bench --model facebook/opt-1.3b --dummy --prompt-len 512 --gen-len 32 --offload-dir "$offload" \
    --warmup 0 --label "$label" --json "$out/json/$label.json" "$@"
}
#                                weights gpu cpu | cache gpu cpu | activations gpu cpu
bench ram-1x1   --gpu-batch-size 1 --num-gpu-batches 1 --percent 0 100 100 0 100 0
bench ram-4x2   --gpu-batch-size 4 --num-gpu-batches 2 --percent 0 100 100 0 100 0
bench disk-1x1  --gpu-batch-size 1 --num-gpu-batches 1 --percent 0 0 100 0 100 0
bench disk-4x2  --gpu-batch-size 4 --num-gpu-batches 2 --percent 0 0 100 0 100 0
flexgen-helm report --runs-dir "$out/json" --out "$out/report"
