#!/bin/bash
# The 4-bit OLMoE-1B-7B bench of runs/compare/olmoe-1b-7b-p512-g32 (its ours-4bit policy), this
# checkout against an older commit (a git worktree of it), rounds alternating, one process each.
# usage: bash runs/moe/host_memory/ab.sh <old commit> <rounds> <out folder>
set -e
old=$1; rounds=$2; out=$(realpath -m "$3"); here=$(git rev-parse --show-toplevel)
policy=$here/runs/compare/olmoe-1b-7b-p512-g32/2026-11-28_packed/ours-4bit.policy.json
mkdir -p "$out"; tree=$(mktemp -d)/old
git -C "$here" worktree add -q "$tree" "$old"
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
echo "host: $(lscpu | grep 'Model name' | sed 's/ \+/ /g'), $(nproc) cores; new $(git -C "$here" rev-parse --short HEAD) (+ uncommitted: $(git -C "$here" status --short | wc -l) files), old $old" >> "$out/ab.txt"
for i in $(seq 1 "$rounds"); do
  for side in new old; do
    dir=$here; [ $side = old ] && dir=$tree
    echo "$side $i $(date -u +%FT%T) load $(cut -d' ' -f1 /proc/loadavg)" >> "$out/ab.txt"
    (cd "$dir" && python -m flexgen_helm bench --model allenai/olmoe-1b-7b-0924 --dummy --dtype bfloat16 --device cpu \
      --prompt-len 512 --gen-len 32 --gpu-mem 1.5GiB --cpu-mem 4GiB --offload-dir /tmp/flexgen-helm-compare/offload \
      --policy "$policy" --warmup 0 --json "$out/${side}_$i.json" > "$out/${side}_$i.log" 2>&1)
    python -c "import json,sys; d=json.load(open(sys.argv[1])); print('  prefill %.2f s, decode %.2f s, total %.2f s (%.2f tok/s), peak RSS %.2f GiB' % (d['prefill_latency_s'], d['decode_latency_s'], d['total_latency_s'], d['total_throughput'], d['memory']['cpu_peak_rss_bytes'] / 2**30))" "$out/${side}_$i.json" >> "$out/ab.txt"
  done
done
