"""Seconds spent in the block schedule's decode attention and its parts, for a HELM run's
requests through our client (float32, the deployment flexgen/smollm2-135m, the scenario
planned as the BatchingExecutor plans it): the per-function figures of README.md.

    cd <checkout> && PYTHONPATH=. python runs/bench/packed_units/attention_timers.py \
        runs/bench/merged_head/pattern_match_requests.json

Wraps each function with a wall-clock timer (inclusive: `_attend` holds the others; prefill's
60 calls of it too). One run, no interleaving: read it beside a same-session run of the other
checkout, never as a speed-up by itself.
"""

import collections
import functools
import json
import sys
import time
from pathlib import Path

from flexgen_helm.executor import attention, kv_cache, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "merged_head"))
from scenario_client import float32_client, scenario_requests  # found through the path just above

spent, calls = collections.Counter(), collections.Counter()


def timed(owner, name):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
    setattr(owner, name, run)


for owner, name in [(schedule.BlockSchedule, "prefill"), (schedule.BlockSchedule, "decode"),
                    (schedule.BlockSchedule, "_attend"), (attention, "_normalized_part"),
                    (kv_cache.KVCacheSlot, "append_in_place")]:
    timed(owner, name)

requests = scenario_requests(sys.argv[1])
client = float32_client()  # loaded before the clock starts
t0 = time.perf_counter()
client.prefetch(requests)
print(json.dumps({"wall_s": round(time.perf_counter() - t0, 2),
                  **{k: {"s": round(v, 2), "calls": calls[k]} for k, v in spent.most_common()}}))
