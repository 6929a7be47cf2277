#!/usr/bin/env bash
# Issue 51's steps in one call on a lent GPU (device tool; $OUT comes back), each stage
# capped so the whole ends inside the call's limit and a failing stage never stops the next.
# What the first call on an H100 found, and why this call runs what it runs:
# runs/gpu/h100-2026-11-26/README.md.
#   1. the tests that failed there (fixed since), the policy-invariance and family tests, on the GPU
#   2. a profile of the machine, two calibration benches of the paper's setting (OPT-6.7B,
#      16 GiB of GPU, 512 / 32: all on the GPU at 8 sequences, the search's choice once
#      refitted; ours on FlexGen's published placement and batch), the profile refit to them
#      (`profile --refit`)
#   3. overlap on vs off, as in the first call (the stage timers no longer wait for the GPU)
#   4. `flexgen-helm compare` of that setting: ours --policy auto (planned from the refitted
#      profile), the FlexGen reference, HF accelerate, ours with the DeepSpeed policy
# Run from the repository root: bash runs/gpu/h100_checks.sh  (BUDGET_S: seconds for all of it)
# The GPU image lacks gguf and flexgen: carry them as wheels in .whl/ (git-ignored; the device
# tool's `carry: [".whl"]`), fetched here first with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0 flexgen==0.1.8
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
# (the families: sliding-window rings and held-out prefixes on the GPU tier, whose reads fan out)
stage pytest_cuda 90 python3 -m pytest -q -p no:cacheprovider --timeout 60 --device $DEV \
  tests/test_policies.py tests/test_compression.py::test_cuda_matches_cpu \
  tests/test_int4.py::test_cuda_kernel_equals_dequantize_then_matmul tests/test_model_families.py

# 2. the profile (saved where every later command reads it: $FLEXGEN_HELM_CACHE/hardware.json),
# two calibration benches, the refit
stage profile 40 python3 -m flexgen_helm profile --device $DEV --dtype float16
cp "$FLEXGEN_HELM_CACHE/hardware.json" "$RES/profile-h100.json"
C="--model facebook/opt-6.7b --dummy --device $DEV --dtype float16 --prompt-len 512 --gen-len 32 --warmup 1 --quiet"
stage calib_all_gpu_8 50 python3 -m flexgen_helm bench $C --gpu-batch-size 8 --percent 100 0 100 0 100 0 --label "all on the GPU, 8 sequences" --json "$RES/calib_all_gpu_8.json"
# FlexGen's published placement and batch; overlap on, as the refit fits only such runs
stage calib_flexgen_policy 40 python3 -m flexgen_helm bench $C --gpu-batch-size 2 --percent 100 0 100 0 100 0 --label "FlexGen's published placement and batch" --json "$RES/calib_flexgen_policy.json"
# with the cache-streaming run of the first H100 call (the term the calibrations do not bind;
# measured there with the per-layer synchronize since dropped, so it errs slow)
stage refit 20 python3 -m flexgen_helm profile --refit "$RES"/calib_*.json \
  runs/gpu/h100-2026-11-26/call1/compare/opt-6.7b-p512-g32-gpu16/ours-auto.json
cp "$FLEXGEN_HELM_CACHE/hardware.json" "$RES/profile-h100-refit.json"

# 3. overlap on vs off again (OPT-1.3B from RAM, as in the first call),
# now that the GPU's stage timers no longer wait for it unless asked (--breakdown)
B="--model facebook/opt-1.3b --dummy --device $DEV --dtype float16 --prompt-len 512 --gen-len 32 --gpu-batch-size 32 --num-gpu-batches 4 --warmup 1 --quiet --percent 0 100 100 0 100 0"
stage overlap_ram_on 30 python3 -m flexgen_helm bench $B --label "weights in RAM, overlap" --json "$RES/overlap_ram_on.json"
stage overlap_ram_off 30 python3 -m flexgen_helm bench $B --no-overlap --label "weights in RAM, no overlap" --json "$RES/overlap_ram_off.json"

# 4. the paper's benchmark (each row's JSON is written as it ends: a timeout keeps those done)
stage compare_opt67b 270 python3 -m flexgen_helm compare --setup opt-6.7b-p512-g32-gpu16 \
  --systems ours-auto flexgen-reference hf-accelerate ours-deepspeed-policy \
  --no-ablations --warmup 1 --timeout 90 --out "$RES/compare"
