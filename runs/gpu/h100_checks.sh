#!/usr/bin/env bash
# Issue 51's steps in one call on a lent GPU (device tool; $OUT comes back), each stage
# capped so the whole ends inside the call's limit and a failing stage never stops the next:
#   1. the CUDA-only tests, then the policy-invariance and transformers-equivalence tests on
#      the GPU (pytest --device cuda: float32 and float16)
#   2. overlap on vs off on the same policy, weights in RAM and on disk (bench's per-stage
#      breakdown), after a profile of the machine for the cost model
#   3. the paper's setting: OPT-6.7B, 16 GiB of GPU, prompt 512 / gen 32, `flexgen-helm compare`
#   4. with time left, the model-family and MoE tests on the GPU
# Run from the repository root: bash runs/gpu/h100_checks.sh  (BUDGET_S: seconds for all of it)
set -u
BUDGET_S=${BUDGET_S:-560}
DEV=${DEV:-cuda}  # cpu: a dry run of this script on a machine without a GPU
OUT=${OUT:-/tmp/gpu-out}
RES=/tmp/gpu-results
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export FLEXGEN_HELM_CACHE=/tmp/fh-cache FLEXGEN_HELM_OFFLOAD=/tmp/fh-offload FLEXGEN_HELM_COMPARE_DIR=/tmp/fh-compare
if ls .whl/*.whl >/dev/null 2>&1; then  # what the GPU machine's image lacks: gguf, flexgen 0.1.8 (the reference)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
left() { echo $(( BUDGET_S - SECONDS )); }
# stage NAME CAP CMD...: runs CMD with at most CAP seconds (less if the budget is nearly spent)
stage() {
  local name=$1 cap=$2; shift 2
  local t=$(( $(left) < cap ? $(left) : cap ))
  if (( t < 20 )); then echo "== $name: skipped, ${t} s left" | tee -a "$RES/summary.txt"; return; fi
  local s0=$SECONDS
  timeout -k 5 "$t" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $(( SECONDS - s0 )) s (cap $t s)" | tee -a "$RES/summary.txt"
  tail -n 4 "$RES/$name.log" | sed 's/^/   /' | tee -a "$RES/summary.txt"
}
finish() {
  cp "$RES/summary.txt" "$OUT/summary.txt"
  cp "$RES/pytest_cuda.log" "$OUT/" 2>/dev/null
  tar -czf "$OUT/results.tar.gz" -C "$RES" . 2>/dev/null
}
trap finish EXIT

{ date -u; uname -r; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  nproc; free -g | head -2; df -h /tmp | tail -1
  python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)'
  cat /proc/loadavg; } > "$RES/env.txt" 2>&1
cat "$RES/env.txt" | tee "$RES/summary.txt"

# 1. tests on the GPU
stage pytest_cuda 120 python3 -m pytest -q -p no:cacheprovider --timeout 90 --device $DEV \
  tests/test_policies.py tests/test_transformers_equivalence.py \
  tests/test_int4.py::test_cuda_kernel_equals_dequantize_then_matmul tests/test_compression.py::test_cuda_matches_cpu

# 2. a profile of this machine (the cost model's), then overlap on vs off on one policy:
# OPT-1.3B fp16, 4 x 32 sequences; weights in RAM (512 / 32), half of them on disk (512 / 8)
stage profile 90 python3 -m flexgen_helm profile --device $DEV --dtype float16 --json "$RES/profile-h100.json"
mkdir -p ~/.cache/flexgen-helm && cp "$RES/profile-h100.json" ~/.cache/flexgen-helm/hardware.json
B="--model facebook/opt-1.3b --dummy --device $DEV --dtype float16 --prompt-len 512 --gpu-batch-size 32 --num-gpu-batches 4 --warmup 1 --quiet"
stage overlap_ram_on 35 python3 -m flexgen_helm bench $B --gen-len 32 --percent 0 100 100 0 100 0 --label "weights in RAM, overlap" --json "$RES/overlap_ram_on.json"
stage overlap_ram_off 35 python3 -m flexgen_helm bench $B --gen-len 32 --percent 0 100 100 0 100 0 --no-overlap --label "weights in RAM, no overlap" --json "$RES/overlap_ram_off.json"
stage overlap_disk_on 35 python3 -m flexgen_helm bench $B --gen-len 8 --percent 0 50 100 0 100 0 --label "half the weights on disk, overlap" --json "$RES/overlap_disk_on.json"
stage overlap_disk_off 30 python3 -m flexgen_helm bench $B --gen-len 8 --percent 0 50 100 0 100 0 --no-overlap --label "half the weights on disk, no overlap" --json "$RES/overlap_disk_off.json"

# 3. the paper's benchmark (each row's JSON is written as it ends: a timeout keeps those done)
stage compare_opt67b 240 python3 -m flexgen_helm compare --setup opt-6.7b-p512-g32-gpu16 \
  --systems ours-auto flexgen-reference hf-accelerate ours-deepspeed-policy ours-4bit flexgen-reference-4bit \
  --no-ablations --warmup 1 --timeout 90 --out "$RES/compare"

# 4. the families and MoE on the GPU, with what is left
stage pytest_families 200 python3 -m pytest -q -p no:cacheprovider --timeout 60 --device $DEV \
  tests/test_model_families.py tests/test_moe.py tests/test_gpt_oss.py
