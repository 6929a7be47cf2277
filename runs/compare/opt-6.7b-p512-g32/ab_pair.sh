#!/usr/bin/env bash
# ab_pair.sh BEFORE AFTER POLICY LOG: one `flexgen-helm bench` of OPT-6.7B dummy weights at prompt
# 64 / gen 6 (the setup's budgets) on commit BEFORE, then the same on commit AFTER, each from a
# git worktree of that commit (removed afterwards), one after the other; run it alone. Writes
# LOG: host, each side's load average and its prefill/decode lines and per-step breakdown.
set -euo pipefail
before=$1 after=$2 policy=$(realpath "$3") log=$4
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
ARGS="bench --model facebook/opt-6.7b --dummy --dtype bfloat16 --device cpu --prompt-len 64 --gen-len 6
      --gpu-mem 1.5GiB --cpu-mem 4GiB --offload-dir /tmp/flexgen-helm-compare/offload --policy $policy --warmup 0"
{ echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $(date -u +%FT%TZ)"
for side in before after; do
  commit=$([ $side = before ] && echo "$before" || echo "$after")
  tree=$(mktemp -d /tmp/ab-XXXXXX)
  git -C "$repo" worktree add -q --detach "$tree" "$commit"
  echo "== $side ($(git -C "$tree" rev-parse --short HEAD)), load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)"
  (cd "$tree" && PYTHONPATH="$tree" python -m flexgen_helm $ARGS 2>&1 | tr '\r' '\n' \
     | grep -a "^decode\|a decode step\|^prefill:\|^total" | grep -av "step/s\]")
  git -C "$repo" worktree remove --force "$tree"
done
echo "load after $(cut -d' ' -f1-3 /proc/loadavg)"; } | tee "$log"
