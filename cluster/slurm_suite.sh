#!/usr/bin/env bash
# A HELM suite through HELM's SlurmRunner on the local Slurm cluster, checked against one
# helm-run process of the same suite (float32), then summarized into one leaderboard.
#
#   sudo cluster/local_slurm.sh start && export SLURM_CONF=/tmp/flexgen-slurm/slurm.conf
#   cluster/slurm_suite.sh [MAX_INSTANCES]        (default 10)
#
# 3 scenarios x 2 deployments = 6 run specs, 6 Slurm jobs (2 at a time: one per node). Each
# side starts from empty caches (HELM's and the converted weight stores), so the Slurm jobs
# convert the shared stores concurrently. Evidence in runs/cluster/suite/: the two helm-run
# logs, every job's log, comparison.json (completion by completion), the leaderboard table.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
M=${1:-10}
WORK=${FLEXGEN_CLUSTER_WORK:-/tmp/flexgen-cluster-work}/suite
OUT=$REPO/runs/cluster/suite
SUITE=cluster
ENTRIES=()
for d in flexgen/smollm2-135m flexgen/smollm2-135m-8bit; do
    ENTRIES+=("lambada:model=$d" "wikitext:model=$d,unit=paragraph" "synthetic_reasoning:mode=pattern_match,model=$d")
done
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} FLEXGEN_HELM_DTYPE=float32 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

python -c "from flexgen_helm.helm.slurm import slurm_problem as p; import sys; m = p(); m and sys.exit(m)"
rm -rf "$WORK" "$OUT"
mkdir -p "$WORK/single/prod_env" "$WORK/slurm/prod_env" "$OUT/jobs"
cp "$REPO/cluster/runner_config.yaml" "$WORK/slurm/prod_env/"
stamp() { date -u +%FT%TZ; }

echo "$(stamp) single process: helm-run -r ${ENTRIES[*]} -m $M --suite $SUITE --runner-class-name flexgen_helm.helm.runner.BatchingRunner" | tee "$OUT/commands.txt"
start=$SECONDS
(cd "$WORK/single" && FLEXGEN_HELM_CACHE=$WORK/single/flexgen-cache timeout 3000 helm-run -r "${ENTRIES[@]}" -m "$M" \
    --suite $SUITE --runner-class-name flexgen_helm.helm.runner.BatchingRunner --exit-on-error >"$OUT/single.log" 2>&1)
echo "$(stamp) single process done in $(( SECONDS - start )) s" | tee -a "$OUT/commands.txt"

echo "$(stamp) Slurm: HELM_MAX_CONCURRENT_WORKER_SLURM_JOBS=2 helm-run -r ${ENTRIES[*]} -m $M --suite $SUITE --runner-class-name helm.benchmark.slurm_runner.SlurmRunner (prod_env/runner_config.yaml = cluster/runner_config.yaml)" | tee -a "$OUT/commands.txt"
start=$SECONDS
(cd "$WORK/slurm" && FLEXGEN_HELM_CACHE=$WORK/slurm/flexgen-cache HELM_MAX_CONCURRENT_WORKER_SLURM_JOBS=2 timeout 3000 \
    helm-run -r "${ENTRIES[@]}" -m "$M" --suite $SUITE --runner-class-name helm.benchmark.slurm_runner.SlurmRunner \
    >"$OUT/slurm.log" 2>&1)
echo "$(stamp) Slurm done in $(( SECONDS - start )) s" | tee -a "$OUT/commands.txt"
for f in "$WORK"/slurm/slurm/*/logs/*.log "$WORK"/slurm/slurm/*/worker_slurm_jobs.json; do
    cp "$f" "$OUT/jobs/$(basename "$f" | tr ':/' '__')"
done

echo "$(stamp) python -m flexgen_helm.tools.suite_diff single slurm --json comparison.json" | tee -a "$OUT/commands.txt"
python -m flexgen_helm.tools.suite_diff "$WORK/single/benchmark_output/runs/$SUITE" \
    "$WORK/slurm/benchmark_output/runs/$SUITE" --json "$OUT/comparison.json" | tee -a "$OUT/commands.txt"

echo "$(stamp) flexgen-helm leaderboard --suite $SUITE (in the Slurm side's folder)" | tee -a "$OUT/commands.txt"
(cd "$WORK/slurm" && timeout 600 python -m flexgen_helm leaderboard --suite $SUITE --out "$OUT/leaderboard" >"$OUT/leaderboard.log" 2>&1) \
    || echo "leaderboard failed: see $OUT/leaderboard.log" | tee -a "$OUT/commands.txt"
cp "$WORK/slurm/benchmark_output/runs/$SUITE"/groups/*.json "$OUT/leaderboard/" 2>/dev/null || true
