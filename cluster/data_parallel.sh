#!/usr/bin/env bash
# The data-parallel HELM scenario over 2 Slurm nodes (srun, one rank per node, torch's env://
# from Slurm's variables: flexgen_helm/dist/rendezvous.py), against one process; then a rank
# whose rendezvous cannot be reached.
#
#   sudo cluster/local_slurm.sh start && export SLURM_CONF=/tmp/flexgen-slurm/slurm.conf
#   cluster/data_parallel.sh [MAX_INSTANCES [REFERENCE_SUITE_DIR]]     (default 32: 2 batches of 16)
#
# REFERENCE_SUITE_DIR: a one-process suite of the same run spec, -m and dtype to compare with
# (cluster/slurm_resume.sh's single-process suite is one) instead of running it here again.
# LAUNCH=torchrun: the same over two torchrun node ranks on 127.0.0.1 (--nnodes 2, static
# rendezvous), no Slurm needed.
# Both "nodes" of the local cluster are this host (1 core each), so every process here runs with
# THREADS_PER_NODE threads (default 1: a node's share of the cores): the one process is one such
# node, and two ranks are two. Run it alone for its times: it records the host and the load
# average beside them. Evidence in runs/cluster/data_parallel_$LAUNCH/.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
M=${1:-32}
REFERENCE=${2:-}
LAUNCH=${LAUNCH:-srun}
WORK=${FLEXGEN_CLUSTER_WORK:-/tmp/flexgen-cluster-work}/data_parallel_$LAUNCH
OUT=$REPO/runs/cluster/data_parallel_$LAUNCH
SUITE=dp
ENTRIES=("lambada:model=flexgen/smollm2-135m")
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} FLEXGEN_HELM_DTYPE=float32 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# converted stores: shared by both sides (and with another script's, if FLEXGEN_HELM_CACHE is set); HELM's
# caches: one per side
export FLEXGEN_HELM_CACHE=${FLEXGEN_HELM_CACHE:-$WORK/flexgen-cache}
# task/none binds no cores, so torch would start a thread per core of the host in every rank
export OMP_NUM_THREADS=${THREADS_PER_NODE:-1}

[ "$LAUNCH" = torchrun ] || python -c "from flexgen_helm.helm.slurm import slurm_problem as p; import sys; m = p(); m and sys.exit(m)"
rm -rf "$WORK" "$OUT"
mkdir -p "$WORK/single" "$WORK/dp" "$OUT"
log() { echo "$(date -u +%FT%TZ) $*" | tee -a "$OUT/commands.txt"; }
load() { cut -d' ' -f1-3 /proc/loadavg; }
log "host: $(python -c 'from flexgen_helm.memory.machine import machine_label; print(machine_label())'); $OMP_NUM_THREADS thread(s) per process; load average $(load)"

if [ -z "$REFERENCE" ]; then
    # a warm-up, untimed: converts the store both sides then read, and fills the page cache
    log "0. warm-up (not timed): helm-run -r ${ENTRIES[*]} -m 1 --suite warmup"
    mkdir -p "$WORK/warmup"
    (cd "$WORK/warmup" && timeout 1800 helm-run -r "${ENTRIES[@]}" -m 1 --suite warmup \
        --runner-class-name flexgen_helm.helm.runner.BatchingRunner >"$OUT/warmup.log" 2>&1)
    REFERENCE=$WORK/single/benchmark_output/runs/$SUITE
    log "1. one process: helm-run -r ${ENTRIES[*]} -m $M --suite $SUITE --runner-class-name flexgen_helm.helm.runner.BatchingRunner"
    start=$SECONDS
    (cd "$WORK/single" && timeout 1800 helm-run -r "${ENTRIES[@]}" -m "$M" --suite $SUITE \
        --runner-class-name flexgen_helm.helm.runner.BatchingRunner >"$OUT/single.log" 2>&1)
    log "one process: $(( SECONDS - start )) s wall (helm-run start to end); load average $(load)"
else
    log "1. one process: the suite in $REFERENCE"
fi

DP_ARGS=(-m flexgen_helm.helm.data_parallel -r "${ENTRIES[@]}" -m "$M" --suite $SUITE)
start=$SECONDS
if [ "$LAUNCH" = torchrun ]; then
    port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    log "2. two node ranks: torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr 127.0.0.1 --master-port $port ${DP_ARGS[*]}   (R = 0, 1)"
    pids=()
    for r in 0 1; do
        (cd "$WORK/dp" && timeout 1800 torchrun --nnodes 2 --node-rank $r --nproc-per-node 1 --master-addr 127.0.0.1 \
            --master-port "$port" "${DP_ARGS[@]}" >"$OUT/dp_node$r.log" 2>&1) &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    cat "$OUT"/dp_node*.log >"$OUT/dp.log"
else
    log "2. two node ranks: srun -N 2 --ntasks-per-node 1 --kill-on-bad-exit=1 python ${DP_ARGS[*]}"
    (cd "$WORK/dp" && timeout 1800 srun -N 2 --ntasks-per-node 1 --kill-on-bad-exit=1 -t 30 -l \
        python "${DP_ARGS[@]}" >"$OUT/dp.log" 2>&1)
fi
log "two node ranks: $(( SECONDS - start )) s wall ($LAUNCH start to end); load average $(load)"
log "$(grep -ah 'rank [01] computed' "$OUT/dp.log" | sed 's/.*INFO *//' | tr '\n' ';')"
log "$(python -m flexgen_helm.tools.suite_diff "$REFERENCE" \
    "$WORK/dp/benchmark_output/runs/$SUITE" --json "$OUT/comparison.json")"

port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
SRUN=(srun -N 1 -n 1 -t 5)
[ "$LAUNCH" = torchrun ] && SRUN=()
log "3. a rank whose rendezvous nobody serves: ${SRUN[*]} env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port FLEXGEN_HELM_RENDEZVOUS_TIMEOUT_S=10 python -m flexgen_helm.helm.data_parallel ..."
start=$SECONDS
set +e
(cd "$WORK/dp" && timeout 300 "${SRUN[@]}" env RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT="$port" FLEXGEN_HELM_RENDEZVOUS_TIMEOUT_S=10 \
    python -m flexgen_helm.helm.data_parallel -r "${ENTRIES[0]}" -m 2 --suite never >"$OUT/unreachable.log" 2>&1)
rc=$?
set -e
log "exit status $rc after $(( SECONDS - start )) s: $(grep -a '^flexgen data-parallel' "$OUT/unreachable.log")"
sleep 2
log "python processes of flexgen_helm.helm.data_parallel left: $(ps -eo pid,args | grep -cE '^ *[0-9]+ [^ ]*python[^ ]* -m flexgen_helm.helm.data_parallel' || true)"
