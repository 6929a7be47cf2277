#!/usr/bin/env bash
# Issue 51's steps in one call on a lent GPU (device tool; $OUT comes back), each stage
# capped so the whole ends inside the call's limit and a failing stage never stops the next.
# What the calls on an H100 and on H200s found, and why this call runs what it runs:
# runs/gpu/h100-2026-11-26/README.md, runs/gpu/h200-2026-11-28/README.md, runs/gpu/h200-2026-11-29/README.md.
#   1. the GPU tests (attention without cuDNN's kernel, the copy engine, the quantizer) and the
#      policy-invariance tests, with the copies on streams (the default) and on worker threads
#   2. a profile of the machine
#   3. overlap on (streams; threads) vs off
#   4. `flexgen-helm compare` of the paper's setting: ours searched and with the DeepSpeed-style
#      policy, FlexGen's own code, ours with 4-bit weights; then a trace of the searched OPT-6.7B
#      policy's decode step (runs/gpu/decode_trace.py), whose attention held 166 of 256 ms on the last H200
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
unset FLEXGEN_HELM_CUDA_COPIES  # the stages that do not set it run the default (streams)
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

# 1. tests on the GPU: attention keeps off cuDNN's kernel, the policy-invariance tests, the
# copy engine, the quantizer on CUDA; then the policy tests again with the copies on threads
stage pytest_cuda 80 python3 -m pytest -q -p no:cacheprovider --timeout 60 --device $DEV \
  tests/test_attention_on_gpu.py tests/test_policies.py tests/test_copy_engine.py \
  tests/test_compression.py::test_cuda_matches_cpu tests/test_int4.py::test_cuda_kernel_equals_dequantize_then_matmul
stage pytest_cuda_threads 50 env FLEXGEN_HELM_CUDA_COPIES=threads python3 -m pytest -q -p no:cacheprovider \
  --timeout 60 --device $DEV tests/test_policies.py

# 2. the profile (saved where every later command reads it: $FLEXGEN_HELM_CACHE/hardware.json)
stage profile 40 python3 -m flexgen_helm profile --device $DEV --dtype float16
cp "$FLEXGEN_HELM_CACHE/hardware.json" "$RES/profile.json"

# 3. overlap on (copies on streams, the default; worker threads) vs off: OPT-1.3B from RAM, as on
# the H100 and H200s (on the last H200: 927, 641 and 702 tok/s with cuDNN's attention)
B="--model facebook/opt-1.3b --dummy --device $DEV --dtype float16 --prompt-len 512 --gen-len 32 --gpu-batch-size 32 --num-gpu-batches 4 --warmup 1 --quiet --percent 0 100 100 0 100 0"
stage overlap_ram_streams 30 python3 -m flexgen_helm bench $B --label "weights in RAM, overlap, streams" --json "$RES/overlap_ram_streams.json"
stage overlap_ram_threads 30 env FLEXGEN_HELM_CUDA_COPIES=threads python3 -m flexgen_helm bench $B --label "weights in RAM, overlap, threads" --json "$RES/overlap_ram_threads.json"
stage overlap_ram_off 30 python3 -m flexgen_helm bench $B --no-overlap --label "weights in RAM, no overlap" --json "$RES/overlap_ram_off.json"

# 4. the paper's setting (OPT-6.7B, 16 GiB of GPU, 512 / 32): the dummy weights converted first
# (78 s on the last H200), the comparison, then a trace of the policy the search chose there
# (166 of its 256 ms a step were cuDNN's attention on the last H200) with what time is left
stage convert_opt67b 120 python3 -m flexgen_helm convert --model facebook/opt-6.7b --dummy --dtype float16
stage compare_opt67b 240 python3 -m flexgen_helm compare --setup opt-6.7b-p512-g32-gpu16 \
  --systems ours-auto flexgen-reference ours-deepspeed-policy ours-4bit --no-ablations --warmup 1 \
  --timeout 90 --out "$RES/compare"
# the policy the comparison's search chose; the last H200's choice where the comparison made none
A="$RES/compare/opt-6.7b-p512-g32-gpu16/ours-auto.policy.json"
[ -f "$A" ] || A='{"gpu_batch_size": 16, "num_gpu_batches": 1, "weights": {"gpu": 1, "cpu": 0, "disk": 0}, "cache": {"gpu": 0.16, "cpu": 0.84, "disk": 0}, "activations": {"gpu": 0, "cpu": 1, "disk": 0}}'
stage trace_opt67b_auto 60 python3 runs/gpu/decode_trace.py --model facebook/opt-6.7b --dummy --device $DEV \
  --dtype float16 --prompt-len 512 --out $RES/trace --label opt67b_auto_streams --policy "$A"
