#!/usr/bin/env bash
# Where a compressed deployment's decode time goes, SmolLM2-135M in RAM, bfloat16, prompt 128,
# 32 new tokens, one GPU batch of 10 rows (the README main job's blocks): each weight path and
# each KV-cache grid against plain bf16, one bench after the other, after a warm-up each, the
# load average beside each. Run it alone:  bash runs/compression_8bit/decode_paths/run.sh [OUT]
# (OUT: where the JSONs and commands.txt go; default this folder. The dtype is the CPU's default:
# bfloat16 where it has bf16 arithmetic, else float32.)
set -euo pipefail
OUT=${1:-$(cd "$(dirname "$0")" && pwd)}
mkdir -p "$OUT"
B=(flexgen-helm bench --model smollm2-135m --prompt-len 128 --gen-len 32 --gpu-batch-size 10 --num-gpu-batches 1
   --warmup 1 --quiet)
W8=(--compress-weight --compress-bits 8 --compress-group-size -1)
W4=(--compress-weight --compress-bits 4 --compress-group-size 32 --quant-method gguf)
declare -A RUNS=(
  [bf16]=""
  [w8-kernel]="${W8[*]} --no-keep-dense-weights"
  [w8-kept]="${W8[*]} --keep-dense-weights"
  [w4-kernel]="${W4[*]} --no-keep-dense-weights"
  [w4-kept]="${W4[*]} --keep-dense-weights"
  [kv8-per-token]="--compress-cache --compress-bits 8 --compress-group-size 64 --cache-grouping per-token"
  [kv4-kivi]="--compress-cache --compress-bits 4 --compress-group-size 64 --cache-grouping kivi"
)
: >"$OUT/commands.txt"
for name in bf16 w8-kernel w8-kept w4-kernel w4-kept kv8-per-token kv4-kivi; do
  # shellcheck disable=SC2086
  cmd=("${B[@]}" ${RUNS[$name]} --label "$name" --json "$OUT/$name.json")
  echo "# $(date -u +%FT%TZ) load average $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/commands.txt"
  echo "${cmd[*]}" >>"$OUT/commands.txt"
  "${cmd[@]}" 2>&1 | grep -E "^(prefill|decode|total):|a decode step" | sed "s/^/$name: /"
done
