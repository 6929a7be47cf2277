#!/usr/bin/env bash
# LAMBADA 500 in bfloat16 before and after the CPU bf16 attention change, the block pinned
# (16 x 1) so that only the attention differs; BEFORE/AFTER commits in their own worktrees,
# alternately, ROUNDS times. Run alone, from the repository root:
#   BEFORE=9cd23ef AFTER=HEAD ROUNDS=1 OUT=runs/lm_eval/lambada_2026-11-25_rows_attention bash runs/lm_eval/lambada_2026-11-25_rows_attention/ab.sh
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${ROUNDS:=1}" "${OUT:?}"
root=$(pwd)
for side in before after; do
  rev=$([ "$side" = before ] && echo "$BEFORE" || echo "$AFTER")
  git worktree remove --force "/work/ab_$side" 2>/dev/null || true
  git worktree add -q --detach "/work/ab_$side" "$rev"
done
{ echo "host: $(python -c 'from flexgen_helm.memory.machine import machine_label; print(machine_label())')"
  echo "before $BEFORE, after $(git rev-parse --short "$AFTER"); block 16 x 1, bfloat16"; uptime; } > "$OUT/ab.txt"
for r in $(seq "$ROUNDS"); do
  for side in before after; do
    json="$root/$OUT/ab_${side}_$r.json"
    (cd /tmp && PYTHONPATH="/work/ab_$side" python -m flexgen_helm eval --task lambada --limit 500 --dtype bfloat16 \
      --gpu-batch-size 16 --num-gpu-batches 1 --quiet --json "$json" > /dev/null)
    python -c "import json, sys; d = json.load(open(sys.argv[1])); m = d['metrics']
print(sys.argv[2], sys.argv[3], 'eval_s', round(d['eval_s'], 1), m)" "$json" "$side" "$r" >> "$OUT/ab.txt"
  done
done
uptime >> "$OUT/ab.txt"
git worktree remove --force /work/ab_before && git worktree remove --force /work/ab_after
