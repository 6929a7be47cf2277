#!/bin/bash
# The README main job with Python's cyclic GC on (plain) and off (this folder's sitecustomize.py on
# PYTHONPATH: gc.disable() in every process, helm-run's included), alternating, two rounds; run
# alone. Each run's report table goes to $OUT/<side>-<round>.csv, the load before it to $OUT/log.txt.
#   CHECKOUT=/work/main OUT=<folder> bash gc_off/ab.sh
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:?}; checkout=${CHECKOUT:?}; mkdir -p "$out"
for round in 1 2; do
  for side in gcoff plain; do
    d=/tmp/gcoff_w_$side; rm -rf $d; mkdir -p $d; cd $d
    pp=$checkout; [ $side = gcoff ] && pp=$here:$checkout
    echo "$side $round load $(cut -d' ' -f1 /proc/loadavg)" >> "$out/log.txt"
    PYTHONPATH=$pp flexgen-helm demo -m 10 --suite s --output-path $d/bo --archives $d/runs > "$out/$side-$round.log" 2>&1 \
      || { echo "demo failed: $out/$side-$round.log"; exit 1; }
    cp $d/runs/s/helm_runs.csv "$out/$side-$round.csv"
  done
done
