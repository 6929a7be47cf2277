#!/usr/bin/env bash
# The pipeline over layers (`generate --pipeline`, flexgen_helm/dist/pipeline.py) launched by
# srun over 2 Slurm nodes, one stage per node (torch's env:// from Slurm's variables:
# flexgen_helm/dist/rendezvous.py), against one process on the same prompts (float32).
#
#   sudo cluster/local_slurm.sh start && export SLURM_CONF=/tmp/flexgen-slurm/slurm.conf
#   cluster/pipeline_srun.sh [PROMPTS [NEW_TOKENS]]     (default 8 LAMBADA passages, 8 new tokens)
#
# The prompts are the first PROMPTS passages of LAMBADA ($FLEXGEN_HELM_DATA or
# /work/shared/data) without their last word. Greedy decoding: token ids and logprobs of the
# runs are compared (one process; 2 stages by srun; the same 2 stages by torchrun on this host).
# Both "nodes" of the local cluster are this host: no timing is claimed. Evidence in
# runs/cluster/pipeline_srun/.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
N=${1:-8}
NEW=${2:-8}
DATA=${FLEXGEN_HELM_DATA:-/work/shared/data}/lambada/lambada_openai_test.jsonl
WORK=${FLEXGEN_CLUSTER_WORK:-/tmp/flexgen-cluster-work}/pipeline_srun
OUT=$REPO/runs/cluster/pipeline_srun
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export FLEXGEN_HELM_CACHE=${FLEXGEN_HELM_CACHE:-$WORK/flexgen-cache}   # the converted store, shared by both runs

python -c "from flexgen_helm.helm.slurm import slurm_problem as p; import sys; m = p(); m and sys.exit(m)"
[ -f "$DATA" ] || { echo "pipeline_srun: $DATA not found (set FLEXGEN_HELM_DATA)" >&2; exit 2; }
rm -rf "$WORK" "$OUT"
mkdir -p "$WORK" "$OUT"
log() { echo "$(date -u +%FT%TZ) $*" | tee -a "$OUT/commands.txt"; }

mapfile -t PROMPTS < <(python - "$DATA" "$N" <<'P'
import json, sys
with open(sys.argv[1]) as f:
    for _, line in zip(range(int(sys.argv[2])), f):
        print(" ".join(json.loads(line)["text"].split()[:-1]))
P
)
# 2 GPU batches of 2 per block: the pipeline's micro-batches (one per stage) are real
ARGS=(generate --model smollm2-135m --dtype float32 --max-new-tokens "$NEW" --gpu-batch-size 2
      --num-gpu-batches 2)
SHOWN="python -m flexgen_helm ${ARGS[*]} --prompt <the first $N LAMBADA passages, last word dropped>"

log "1. one process: $SHOWN --json single.json"
(cd "$WORK" && timeout 1800 python -m flexgen_helm "${ARGS[@]}" --offload-dir "$WORK/offload-single" \
    --json "$OUT/single.json" --prompt "${PROMPTS[@]}" >"$OUT/single.log" 2>&1)
log "2. two stages: srun -N 2 --ntasks-per-node 1 --kill-on-bad-exit=1 -l ${SHOWN/generate/generate --pipeline} --json pipeline.json"
(cd "$WORK" && timeout 1800 srun -N 2 --ntasks-per-node 1 --kill-on-bad-exit=1 -t 30 -l \
    bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME" >&2; exec "$@"' _ \
    python -m flexgen_helm "${ARGS[@]}" --pipeline --offload-dir "$WORK/offload-pipeline" \
    --json "$OUT/pipeline.json" --prompt "${PROMPTS[@]}" >"$OUT/pipeline.log" 2>&1)
log "$(grep -ah 'task [01] of 2 on' "$OUT/pipeline.log" | tr '\n' ';')"
port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
log "3. the same two stages under torchrun on this host: torchrun --nproc-per-node 2 --master-port $port -m flexgen_helm ${SHOWN#python -m flexgen_helm } --pipeline --json torchrun.json"
(cd "$WORK" && timeout 1800 torchrun --nproc-per-node 2 --master-port "$port" -m flexgen_helm "${ARGS[@]}" --pipeline \
    --offload-dir "$WORK/offload-torchrun" --json "$OUT/torchrun.json" --prompt "${PROMPTS[@]}" >"$OUT/torchrun.log" 2>&1)
compare() {  # completions of two runs: token ids, and logprobs compared exactly
    python - "$OUT/$1.json" "$OUT/$2.json" <<'P'
import json, sys
a, b = (json.load(open(p))["results"] for p in sys.argv[1:])
assert [r["prompt"] for r in a] == [r["prompt"] for r in b], "the two runs had different prompts"
pairs = [(ca, cb) for ra, rb in zip(a, b) for ca, cb in zip(ra["completions"], rb["completions"])]
ids = sum(ca["token_ids"] != cb["token_ids"] for ca, cb in pairs)
lps = sum(ca["logprobs"] != cb["logprobs"] for ca, cb in pairs)
gap = max((abs(x - y) for ca, cb in pairs for x, y in zip(ca["logprobs"], cb["logprobs"])), default=0.0)
tokens = sum(len(ca["token_ids"]) for ca, _ in pairs)
print(f"{sys.argv[1].rsplit('/', 1)[-1]} vs {sys.argv[2].rsplit('/', 1)[-1]}: {len(pairs)} completions, {tokens} tokens; "
      f"token ids differ in {ids}, logprobs not bitwise equal in {lps} (largest difference {gap:.3g})")
P
}
log "$(compare single pipeline)"
log "$(compare pipeline torchrun)"
