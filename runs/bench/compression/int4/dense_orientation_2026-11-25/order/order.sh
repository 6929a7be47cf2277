#!/bin/bash
# Does the 4-bit deployment's place in the helm-run process set its prefill time? helm-run of
# LAMBADA and WikiText paragraphs (-m 10, the main job's batching runner, -n 2), BF16 and 4-bit
# only, in the order "bf16-first" and "4bit-first", alternating, ROUNDS rounds, from empty HELM
# caches; each run's report table is copied to $OUT/<order>-<round>.csv.
#   ROUNDS=2 OUT=<folder> bash order.sh
set -u
out=${OUT:?}; mkdir -p "$out"
B=flexgen/smollm2-135m; F=flexgen/smollm2-135m-4bit
entries() { for d in "$@"; do echo "lambada:model=$d wikitext:unit=paragraph,model=$d"; done; }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for order in 4bit-first bf16-first; do
    w=/tmp/order_$order; rm -rf $w; mkdir -p $w; cd $w
    if [ $order = bf16-first ]; then e=$(entries $B $F); else e=$(entries $F $B); fi
    echo "$order $round start load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/log.txt"
    helm-run -r $e -m 10 --suite s -o $w/bo -n 2 --runner-class-name flexgen_helm.helm.runner.BatchingRunner \
      > "$out/$order-$round.log" 2>&1 || { echo "helm-run failed: $out/$order-$round.log"; exit 1; }
    flexgen-helm report --suite s --output-path $w/bo --archives $w/runs >> "$out/$order-$round.log" 2>&1
    cp $w/runs/s/helm_runs.csv "$out/$order-$round.csv"
  done
done
echo "end load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/log.txt"
