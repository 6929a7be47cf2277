#!/bin/bash
# main job with python's cyclic GC on (plain) vs off (sitecustomize gc.disable), alternating
out=/tmp/gcoff/out; mkdir -p $out
for round in 1 2; do
  for side in gcoff plain; do
    d=/tmp/gcoff/w_$side; rm -rf $d; mkdir -p $d; cd $d
    pp=/work/main; [ $side = gcoff ] && pp=/tmp/gcoff:/work/main
    echo "$side $round load $(cut -d' ' -f1 /proc/loadavg)" >> $out/log.txt
    PYTHONPATH=$pp flexgen-helm demo -m 10 --suite s --output-path $d/bo --archives $d/runs > $out/$side-$round.log 2>&1
    cp $d/runs/s/helm_runs.csv $out/$side-$round.csv
  done
done
