#!/usr/bin/env bash
# Kill and resubmit: a SlurmRunner job (or helm-run, its manager) is killed after the job's first
# batches are in HELM's cache; the same helm-run again computes only what is missing, and the
# suite equals one uninterrupted helm-run process (float32).
#
#   sudo cluster/local_slurm.sh start && export SLURM_CONF=/tmp/flexgen-slurm/slurm.conf
#   cluster/slurm_resume.sh [MAX_INSTANCES [REFERENCE_SUITE_DIR]]   (default 32: 3 batches of up to 16)
#
# KILL=scancel (default): Slurm cancels the job (SIGTERM, then SIGKILL after KillWait).
# KILL=kill9: every process of the job on its node (the batch shell and the Python worker, found
# by SLURM_JOB_ID in their environment) gets SIGKILL at once, as an OOM killer or a crash would
# leave it: nothing of the job can clean up; Slurm sees the batch script die and fails the job.
# KILL=manager: helm-run itself (HELM's SlurmRunner, the manager) gets SIGKILL while its job runs:
# its `finally` that cancels its jobs does not run, so the job goes on; the same command again,
# started at once, finds that job (flexgen_helm/helm/slurm_orphans.py) and follows it instead of
# submitting a second one.
# REFERENCE_SUITE_DIR: a one-process suite of the same run spec, -m and dtype to compare with,
# instead of running it here first.
# Evidence in runs/cluster/resume/ (scancel), runs/cluster/kill9/ or runs/cluster/kill_manager/:
# commands.txt (with the counts), the logs of both helm-runs and of the jobs, comparison.json.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
M=${1:-32}
REFERENCE=${2:-}
KILL=${KILL:-scancel}
case $KILL in
    scancel) NAME=resume ;;
    kill9) NAME=kill9 ;;
    manager) NAME=kill_manager ;;
    *) echo "slurm_resume: KILL=$KILL: expected scancel, kill9 or manager" >&2; exit 2 ;;
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
CACHE=$WORK/slurm/prod_env/cache/flexgen.sqlite
cached() { python -m flexgen_helm.tools.slurm_faults cached "$CACHE"; }  # completions in the Slurm side's HELM cache
slurm_run() {
    (cd "$WORK/slurm" && exec timeout $WAIT_S helm-run -r "$ENTRY" -m "$M" --suite $SUITE \
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
job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]* Reason=[^ ]*\|ExitCode=[0-9:]*' | tr '\n' ' '; }
wait_job_gone() { timeout 60 bash -c "while [ -n \"\$(squeue -h -j $1 -o %i 2>/dev/null)\" ]; do sleep 0.5; done" || true; }
kill_job() {
    case $KILL in
    scancel)
        log "scancel $1   ($(cached) requests cached)"
        scancel "$1" ;;
    kill9)
        log "kill -9 of every process of job $1 on $(squeue -h -j "$1" -o %N) ($(cached) requests cached): $(python -m flexgen_helm.tools.slurm_faults kill9 "$1")"
        wait_job_gone "$1"
        log "job $1 after the kill: $(job_state "$1")"
        log "job $1's processes left: $(python -m flexgen_helm.tools.slurm_faults processes "$1" | wc -l)" ;;
    manager)
        local helm_run  # $manager: slurm_run's subshell; its child: timeout; timeout's child: helm-run
        helm_run=$(pgrep -P "$(pgrep -P "$manager")")
        log "kill -9 $helm_run (helm-run, the manager: $(ps -o args= -p "$helm_run" | cut -c1-80)...; job $1 on $(squeue -h -j "$1" -o %N); $(cached) requests cached)"
        kill -9 "$helm_run"
        sleep 5
        log "5 s later: job $1 $(job_state "$1"); its processes: $(python -m flexgen_helm.tools.slurm_faults processes "$1" | wc -l); $(cached) requests cached" ;;
    esac
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
wait $manager && { log "the killed run's helm-run exited 0: expected it to report the failed run or be killed"; exit 1; } || true
job_logs() { ls -tr "$WORK"/slurm/slurm/*/logs/*.log; }
if [ "$KILL" != manager ]; then
    cp "$(job_logs | tail -1)" "$OUT/jobs/killed_job.log"
    log "killed run: $(grep -ao 'RunnerError: Failed runs: .*' "$OUT/slurm_killed.log" | head -1); $(cached) requests cached"
fi

log "3. the same command again: $RUN_CMD"
slurm_run slurm_resumed.log
if [ "$KILL" = manager ]; then
    grep -aq 'still running as Slurm job' "$OUT/slurm_resumed.log" \
        || log "the job had ended before the rerun looked for it: nothing to follow (a larger MAX_INSTANCES keeps it running longer)"
    log "the rerun: $(grep -ao 'flexgen: .*still running as Slurm job.*' "$OUT/slurm_resumed.log" | sed 's/ (log: [^)]*)//' | head -1)"
    # HELM's manager logs a followed job as "submitted" too: the ids say which
    log "jobs of the run: $(cat "$OUT"/slurm_*.log | grep -ao 'Worker Slurm job submitted .* ID: [0-9]*' | grep -o '[0-9]*$' | sort -u | paste -sd ' '); job logs: $(job_logs | wc -l); jobs cancelled by the rerun: $(grep -ac 'flexgen: cancelling' "$OUT/slurm_resumed.log")"
    cp "$(job_logs | tail -1)" "$OUT/jobs/job.log"
    log "the job: $(grep -a 'flexgen: running' "$OUT/jobs/job.log" | sed 's/.*INFO *//' | paste -sd ';')"
    log "the job: $(grep -a 'flexgen.sqlite:' "$OUT/jobs/job.log" | tail -1 | sed 's/.*INFO *//')"
    log "after the rerun: job $job $(job_state "$job")"
else
    cp "$(job_logs | tail -1)" "$OUT/jobs/resumed_job.log"
    log "killed job: $(grep -a 'flexgen: running' "$OUT/jobs/killed_job.log" | tail -1 | sed 's/.*INFO *//')"
    log "resumed job: $(grep -a 'flexgen: running' "$OUT/jobs/resumed_job.log" | tail -1 | sed 's/.*INFO *//')"
    log "resumed job: $(grep -a 'flexgen.sqlite:' "$OUT/jobs/resumed_job.log" | tail -1 | sed 's/.*INFO *//')"
fi

log "$(python -m flexgen_helm.tools.suite_diff "$REFERENCE" \
    "$WORK/slurm/benchmark_output/runs/$SUITE" --json "$OUT/comparison.json")"
