#!/usr/bin/env bash
# Issue 3 benchmarks on a CPU-only machine: what group-wise 4-bit compression does to throughput
# when weights or KV cache live on the CPU tier or on disk. OPT-1.3B with dummy weights,
# prompt 512 / gen 32, block 4 x 2 (8 sequences), no warm-up run (the prefill warms the engine).
# Writes runs/bench/compression/json/*.json and report/ (tables built from those files).
# MODEL, PROMPT_LEN, GEN_LEN, OUT, OFFLOAD_DIR and ONLY (row labels) may be overridden (e.g. a quick smoke run).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-runs/bench/compression}
offload=${OFFLOAD_DIR:-/tmp/flexgen-helm-offload}
mkdir -p "$out/json"
uptime > "$out/loadavg-start.txt"
bench() {
  local label=$1; shift
  # ONLY="weights-ram weights-ram-w4": run just those rows (each row is minutes on 2 cores)
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $label "* ]]; then return 0; fi
  flexgen-helm bench --model "${MODEL:-facebook/opt-1.3b}" --dummy --prompt-len "${PROMPT_LEN:-512}" \
    --gen-len "${GEN_LEN:-32}" --offload-dir "$offload" --warmup 0 \
    --gpu-batch-size 4 --num-gpu-batches 2 --label "$label" --json "$out/json/$label.json" "$@"
}
w4=(--compress-weight --compress-bits 4 --compress-group-size 64)
kv4=(--compress-cache --compress-bits 4 --compress-group-size 64)
#                                       weights gpu cpu | cache gpu cpu | activations gpu cpu
bench weights-ram                --percent 0 100 100 0 100 0
bench weights-ram-w4             --percent 0 100 100 0 100 0 "${w4[@]}"
bench weights-disk               --percent 0 0   100 0 100 0
bench weights-disk-w4            --percent 0 0   100 0 100 0 "${w4[@]}"
bench cache-disk                 --percent 0 100 0   0 100 0
bench cache-disk-kv4             --percent 0 100 0   0 100 0 "${kv4[@]}"
bench all-disk-w4-kv4            --percent 0 0   0   0 100 0 "${w4[@]}" "${kv4[@]}"
uptime > "$out/loadavg-end.txt"
flexgen-helm report --runs-dir "$out/json" --out "$out/report"
