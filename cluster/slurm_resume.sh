#!/usr/bin/env bash
# Kill and resubmit: a SlurmRunner job is killed after its first batches are in HELM's cache;
# the same helm-run again computes only what is missing, and the suite equals one
# uninterrupted helm-run process (float32).
#
#   sudo cluster/local_slurm.sh start && export SLURM_CONF=/tmp/flexgen-slurm/slurm.conf
#   cluster/slurm_resume.sh [MAX_INSTANCES [REFERENCE_SUITE_DIR]]   (default 32: 3 batches of up to 16)
#
# KILL=scancel (default): Slurm cancels the job (SIGTERM, then SIGKILL after KillWait).
# KILL=kill9: every process of the job on its node (the batch shell and the Python worker, found
# by SLURM_JOB_ID in their environment) gets SIGKILL at once, as an OOM killer or a crash would
# leave it: nothing of the job can clean up; Slurm sees the batch script die and fails the job.
# REFERENCE_SUITE_DIR: a one-process suite of the same run spec, -m and dtype to compare with,
# instead of running it here first.
# Evidence in runs/cluster/resume/ (scancel) or runs/cluster/kill9/: commands.txt (with the
# counts), the logs of both helm-runs and both jobs, comparison.json.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
M=${1:-32}
REFERENCE=${2:-}
KILL=${KILL:-scancel}
case $KILL in
    scancel) NAME=resume ;;
    kill9) NAME=kill9 ;;
    *) echo "slurm_resume: KILL=$KILL: expected scancel or kill9" >&2; exit 2 ;;
esac
WORK=${FLEXGEN_CLUSTER_WORK:-/tmp/flexgen-cluster-work}/$NAME
OUT=$REPO/runs/cluster/$NAME
SUITE=resume
ENTRY="lambada:model=flexgen/smollm2-135m"
KILL_AFTER=16      # cached requests (one batch) before the job is cancelled
WAIT_S=1800        # at most this long for each step
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} FLEXGEN_HELM_DTYPE=float32 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

python -c "from flexgen_helm.helm.slurm import slurm_problem as p; import sys; m = p(); m and sys.exit(m)"
rm -rf "$WORK" "$OUT"
mkdir -p "$WORK/single/prod_env" "$WORK/slurm/prod_env" "$OUT/jobs"
cp "$REPO/cluster/runner_config.yaml" "$WORK/slurm/prod_env/"
export FLEXGEN_HELM_CACHE=${FLEXGEN_HELM_CACHE:-$WORK/flexgen-cache}   # converted stores shared by both sides: HELM's caches are not
log() { echo "$(date -u +%FT%TZ) $*" | tee -a "$OUT/commands.txt"; }
cached() {  # completions in the Slurm side's HELM cache (tokenizer calls are cached there too)
    python - "$WORK/slurm/prod_env/cache/flexgen.sqlite" <<'P'
import sqlite3, sys, os
path = sys.argv[1]
if not os.path.exists(path):
    print(0)
else:
    try:
        print(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5).execute(
            "select count(*) from unnamed where key like '%\"max_tokens\"%'").fetchone()[0])
    except sqlite3.Error:
        print(0)
P
}
slurm_run() {
    (cd "$WORK/slurm" && timeout $WAIT_S helm-run -r "$ENTRY" -m "$M" --suite $SUITE \
        --runner-class-name helm.benchmark.slurm_runner.SlurmRunner >"$OUT/$1" 2>&1)
}
RUN_CMD="helm-run -r $ENTRY -m $M --suite $SUITE --runner-class-name helm.benchmark.slurm_runner.SlurmRunner"

if [ -z "$REFERENCE" ]; then
    REFERENCE=$WORK/single/benchmark_output/runs/$SUITE
    log "1. one uninterrupted process: helm-run -r $ENTRY -m $M --suite $SUITE --runner-class-name flexgen_helm.helm.runner.BatchingRunner"
    start=$SECONDS
    (cd "$WORK/single" && timeout $WAIT_S helm-run -r "$ENTRY" -m "$M" --suite $SUITE \
        --runner-class-name flexgen_helm.helm.runner.BatchingRunner >"$OUT/single.log" 2>&1)
    log "one process: $(( SECONDS - start )) s wall (helm-run start to end)"
else
    log "1. one uninterrupted process: the suite in $REFERENCE"
fi
job_processes() {  # the job's processes on its node: those whose environment names the job (not slurmstepd:
    local p          # Slurm's own agent stays, to report the job's end, as it would on a node that survives)
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] && continue
        tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -qx "SLURM_JOB_ID=$1" && echo "${p#/proc/}"
    done
    return 0
}
kill_job() {
    if [ "$KILL" = scancel ]; then
        log "scancel $1   ($(cached) requests cached)"
        scancel "$1"
        return
    fi
    local pids
    pids=$(job_processes "$1" | paste -sd ' ')
    [ -n "$pids" ] || { log "job $1 has no process on this host to kill"; exit 1; }
    log "kill -9 $pids  (job $1 on $(squeue -h -j "$1" -o %N); $(cached) requests cached): $(ps -o pid=,args= -p "${pids// /,}" | cut -c1-110 | tr -s ' ' | paste -sd ';')"
    kill -9 $pids
    timeout 60 bash -c "while [ -n \"\$(squeue -h -j $1 -o %i 2>/dev/null)\" ]; do sleep 0.5; done" || true
    log "job $1 after the kill: $(scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]* Reason=[^ ]*\|ExitCode=[0-9:]*' | tr '\n' ' ')"
    log "job $1's processes left: $(job_processes "$1" | wc -l)"
}
log "2. $RUN_CMD   (in the background; KILL=$KILL once $KILL_AFTER requests are in HELM's cache)"
slurm_run slurm_killed.log &
manager=$!
deadline=$(( SECONDS + WAIT_S ))
job=""
while [ $SECONDS -lt $deadline ]; do
    job=$(timeout 10 squeue -h -o '%i|%Z' 2>/dev/null | awk -F'|' -v d="$WORK/slurm" '$2 == d {print $1}' | head -1 || true)
    [ -n "$job" ] && [ "$(cached)" -ge $KILL_AFTER ] && break
    kill -0 $manager 2>/dev/null || { log "helm-run ended before the kill"; exit 1; }
    sleep 1
done
[ -n "$job" ] || { log "no job to kill within $WAIT_S s"; kill $manager; exit 1; }
kill_job "$job"
wait $manager && { log "the killed run's helm-run exited 0: expected it to report the failed run"; exit 1; } || true
newest_job_log() { ls -t "$WORK"/slurm/slurm/*/logs/*.log | head -1; }
cp "$(newest_job_log)" "$OUT/jobs/killed_job.log"
log "killed run: $(grep -ao 'RunnerError: Failed runs: .*' "$OUT/slurm_killed.log" | head -1); $(cached) requests cached"

log "3. the same command again: $RUN_CMD"
slurm_run slurm_resumed.log
cp "$(newest_job_log)" "$OUT/jobs/resumed_job.log"
log "killed job: $(grep -a 'flexgen: running' "$OUT/jobs/killed_job.log" | tail -1 | sed 's/.*INFO *//')"
log "resumed job: $(grep -a 'flexgen: running' "$OUT/jobs/resumed_job.log" | tail -1 | sed 's/.*INFO *//')"
log "resumed job: $(grep -a 'flexgen.sqlite:' "$OUT/jobs/resumed_job.log" | tail -1 | sed 's/.*INFO *//')"

log "$(python -m flexgen_helm.tools.suite_diff "$REFERENCE" \
    "$WORK/slurm/benchmark_output/runs/$SUITE" --json "$OUT/comparison.json")"
