#!/usr/bin/env bash
# Same-run A/B of the merged decode step's cache loads: "before" = dad58fe (each batch's cache
# read after the one before it was attended), "after" = 7a4955c (the whole block's cache of the
# next layer read while this one computes, its disk reads in flight together). The ours-auto
# policy of ../ours-auto.policy.json (block 1 x 16, cache 91% cpu / 9% disk, weights on disk),
# prompt 64 / gen 6 so that a pair takes minutes. Run alone; writes ab_prompt64.log here.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
POL=$here/../ours-auto.policy.json
ARGS="bench --model facebook/opt-6.7b --dummy --dtype bfloat16 --device cpu --prompt-len 64 --gen-len 6 --gpu-mem 1.5GiB --cpu-mem 4GiB --offload-dir /tmp/flexgen-helm-compare/offload --policy $POL --warmup 0"
{ echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $(date -u +%FT%TZ)"
for side in before after; do
  src=$([ $side = before ] && echo /work/wt-before || echo /work/main)
  echo "== $side ($(git -C $src rev-parse --short HEAD)), load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)"
  (cd $src && PYTHONPATH=$src python -m flexgen_helm $ARGS --json /tmp/ab-$side.json 2>&1 | tr '\r' '\n' \
     | grep -a "^decode\|a decode step\|^prefill:\|^total" | grep -av "step/s\]")
done
echo "load after $(cut -d' ' -f1-3 /proc/loadavg)"; } | tee $here/ab_prompt64.log
