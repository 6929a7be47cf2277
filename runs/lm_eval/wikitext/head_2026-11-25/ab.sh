#!/usr/bin/env bash
# A/B of the scored-positions head (issue 24): BEFORE and AFTER commits, each checked out in
# its own worktree, run `eval --protocol documents` on the first 8 WikiText articles
# alternately, ROUNDS times; eval_s of each run goes to OUT/times.txt with the load average.
# Run alone on the machine, from the repository root:
#   BEFORE=129b5c1 AFTER=HEAD ROUNDS=2 OUT=runs/lm_eval/wikitext/head_2026-11-25 bash runs/lm_eval/wikitext/head_2026-11-25/ab.sh
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${ROUNDS:=2}" "${OUT:?}"
root=$(pwd)
for side in before after; do
  rev=$([ "$side" = before ] && echo "$BEFORE" || echo "$AFTER")
  git worktree remove --force "/work/ab_$side" 2>/dev/null || true; git worktree add -q --detach "/work/ab_$side" "$rev"
done
{ echo "host: $(python -c 'from flexgen_helm.memory.machine import machine_label; print(machine_label())')"
  echo "before $BEFORE, after $(git rev-parse --short "$AFTER")"; uptime; } > "$OUT/times.txt"
for r in $(seq "$ROUNDS"); do
  for side in before after; do
    (cd /tmp && PYTHONPATH="/work/ab_$side" python -m flexgen_helm eval --task wikitext --protocol documents \
      --limit 8 --window 1024 --dtype bfloat16 --quiet --json "/tmp/ab_${side}_$r.json" > /dev/null)
    python -c "import json, sys; d = json.load(open(sys.argv[1])); m = d['metrics']
print(sys.argv[2], sys.argv[3], 'eval_s', round(d['eval_s'], 1), 'bits/byte', round(m['bits_per_byte'], 6))" \
      "/tmp/ab_${side}_$r.json" "$side" "$r" >> "$OUT/times.txt"
  done
done
uptime >> "$OUT/times.txt"
cd "$root" && git worktree remove --force /work/ab_before && git worktree remove --force /work/ab_after
