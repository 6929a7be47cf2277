#!/usr/bin/env bash
# Peak process RSS of loading and running OPT-6.7B with 4-bit weights in RAM (this folder's
# ours-4bit.policy.json, prompt 64 / gen 6, the setup's budgets: limit 6.0 GiB), one after the
# other: a2b93dd (before the placement fix), 67af1e9 (with it), and a2b93dd with the engine's
# keep-freed allocator setting off. Each from a worktree of its commit; run alone. Writes
# placement_rss.log here: each run's peak RSS (the bench record's cpu_peak_rss_bytes) and time.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
run() {  # label commit [env...]
  local label=$1 commit=$2; shift 2
  local tree; tree=$(mktemp -d /tmp/rss-XXXXXX)
  git -C "$repo" worktree add -q --detach "$tree" "$commit"
  local t0=$SECONDS load; load=$(cut -d' ' -f1 /proc/loadavg)
  (cd "$tree" && env "$@" PYTHONPATH="$tree" python -m flexgen_helm bench --model facebook/opt-6.7b --dummy \
     --dtype bfloat16 --device cpu --prompt-len 64 --gen-len 6 --gpu-mem 1.5GiB --cpu-mem 4GiB \
     --offload-dir /tmp/flexgen-helm-compare/offload --policy "$here/ours-4bit.policy.json" --warmup 0 \
     --json "$tree/rss.json" > /dev/null 2>&1)
  python -c "import json,sys; m=json.load(open(sys.argv[1]))['memory']; print(f'$label ($commit), load $load: peak RSS {m[\"cpu_peak_rss_bytes\"]/2**30:.2f} GiB, tiers cpu {m[\"tiers\"][\"cpu\"][\"peak_bytes\"]/2**30:.2f} GiB, $((SECONDS - t0)) s')" "$tree/rss.json"
  git -C "$repo" worktree remove --force "$tree"
}
{ echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $(date -u +%FT%TZ)"
  run "before the fix" a2b93dd
  run "with the fix" 67af1e9
  run "before the fix, keep-freed setting off" a2b93dd FLEXGEN_HELM_KEEP_FREED_MEMORY=0
} | tee "$here/placement_rss.log"
