#!/usr/bin/env bash
# The cost model's prediction for this row's plan with the profile's decode overlap loss set to
# 0, 0.1 and 0.2 (a copy of the saved profile each; runs/compare/cost_terms.py):
#   bash runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_midnight/overlap_loss_predictions.sh
cd "$(dirname "$0")/../../../.."
O=runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_midnight
for loss in 0.0 0.1 0.2; do
  python -c "import json, sys; d = json.load(open('$O/hardware-profile-2026-11-29T16-34.json'))
d['disk_overlap_loss'] = {'prefill': 0.0, 'decode': $loss}; json.dump(d, open('/tmp/profile-loss-$loss.json', 'w'))"
  echo "decode overlap loss $loss: $(python runs/compare/cost_terms.py $O/olmoe-1b-7b-p512-g32/ours-4bit.json --profile /tmp/profile-loss-$loss.json 2>&1 | tail -1)"
done
