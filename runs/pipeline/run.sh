#!/usr/bin/env bash
# Issue 7 benchmarks on this CPU machine: the same workload through 1, 2 and 4 pipeline
# stages (torchrun, gloo). On one 2-core machine the stages share the cores, so this
# measures the pipeline's overhead and overlap, not multi-machine scaling.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=runs/pipeline
offload=${OFFLOAD_DIR:-/tmp/flexgen-helm-offload}
mkdir -p "$out/json"
args=(bench --model facebook/opt-1.3b --dummy --prompt-len 128 --gen-len 16 --gpu-batch-size 4 --num-gpu-batches 4
      --percent 0 100 100 0 100 0 --offload-dir "$offload")
flexgen-helm "${args[@]}" --label stages-1 --json "$out/json/stages-1.json"
for n in 2 4; do
  torchrun --nproc-per-node "$n" --master-port $((29500 + n)) -m flexgen_helm "${args[@]}" --pipeline \
    --label "stages-$n" --json "$out/json/stages-$n.json"
done
flexgen-helm report --runs-dir "$out/json" --out "$out/report"
