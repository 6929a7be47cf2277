#!/usr/bin/env bash
# ab.sh BEFORE AFTER ROUNDS NAME: the weights-on-disk rows of runs/bench/compression/run.sh (OPT-1.3B
# dummy, 512/32, block 4 x 2; bf16 and 4-bit weights) on commit BEFORE, then on commit AFTER,
# each from a git worktree of that commit, ROUNDS times in turn. Run it alone. Writes
# runs/bench/compression/disk_reads/NAME/<side>-r<round>/json/*.json and NAME/log.txt (host, load
# average before each side).
set -euo pipefail
before=$1 after=$2 rounds=$3 name=$4
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
here=$here/$name
mkdir -p "$here"
log=$here/log.txt
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $(date -u +%FT%TZ)" | tee "$log"
for round in $(seq "$rounds"); do
  for side in before after; do
    commit=$([ $side = before ] && echo "$before" || echo "$after")
    tree=$(mktemp -d /tmp/ab-XXXXXX)
    git -C "$repo" worktree add -q --detach "$tree" "$commit"
    echo "== round $round, $side ($(git -C "$tree" rev-parse --short HEAD)), load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" | tee -a "$log"
    OUT="$here/$side-r$round" ONLY="weights-disk weights-disk-w4" PYTHONPATH="$tree" bash "$tree/runs/bench/compression/run.sh" \
      > "$here/$side-r$round.out" 2>&1 || { echo "failed: see $here/$side-r$round.out" | tee -a "$log"; exit 1; }
    git -C "$repo" worktree remove --force "$tree"
  done
done
echo "load after $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" | tee -a "$log"
