set -e
POL=/work/main/runs/compare/opt-6.7b-p512-g32/ours-auto.policy.json
ARGS="bench --model facebook/opt-6.7b --dummy --dtype bfloat16 --device cpu --prompt-len 64 --gen-len 6 --gpu-mem 1.5GiB --cpu-mem 4GiB --offload-dir /tmp/flexgen-helm-compare/offload --policy $POL"
for side in merged before; do
  if [ $side = merged ]; then cd /work/wt-merge; else cd /work/main; fi
  echo "$side load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
  PYTHONPATH=$PWD python -m flexgen_helm $ARGS --json /tmp/ab/$side.json 2>&1 | grep -a "decode\b\|a decode step\|prefill:" | grep -v "step/s\]" | tail -3
  python -c "import flexgen_helm;print(flexgen_helm.__file__)"
done
