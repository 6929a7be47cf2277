"""The 8-bit deployment (a per-token 8-bit cache held dense) with a decode step's cache writes,
every layer's and GPU batch's, rounded in one call at the step's end
(BlockSchedule._write_rounded_together) against each write rounding itself
(_rounds_together made False), beside the BF16 deployment, in bfloat16.

    python runs/compression_8bit/decode_paths/step_rounding_ab.py [--rounds 3]

The main job's saved requests through our client, SmolLM2 in RAM: LAMBADA's 10
(runs/bench/merged_head/lambada_requests.json, from `flexgen-helm demo -m 10`) and pattern_match's
first 10 (scenario_paths.py's STATE); each (workload, deployment, setting) in its own process,
the order rotated round by round; seconds in the block schedule's prefill and decode, and how
many step-end calls rounded writes, and how many writes they rounded (a "together" run of the
8-bit deployment with none fails: it would not measure the change). The two settings give the
same tokens and log-probs (tests/test_keep_dense_cache.py). Appends one JSON line per run to
step_rounding_ab.jsonl beside this file, with the host and the load average. (Its forerunner,
rounded_together_ab.py, measured the merged batches of one layer rounded together: its rows are
in rounded_together_ab.jsonl.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scenario_paths import PATHS, REPO, STATE, TIMED_CHILD_HEAD, run_child  # noqa: E402

CHILD = TIMED_CHILD_HEAD + r"""
name, policy, setting = sys.argv[4], json.loads(sys.argv[5]), sys.argv[6]
merged = collections.Counter()  # step-end calls that rounded writes, and the writes they rounded
together = schedule.BlockSchedule._write_rounded_together
def counted(self, stage):
    merged["calls"] += bool(self._rounding_writes)
    merged["writes"] += len(self._rounding_writes)
    return together(self, stage)
schedule.BlockSchedule._write_rounded_together = counted
if setting == "apart":
    schedule.BlockSchedule._rounds_together = lambda self, index, k, new_kv: False
client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment=f"flexgen/smollm2-135m-{name}",
                       dtype="bfloat16", **({"policy": policy} if policy else {}))
_ = client.handle, client.handle.tokenizer  # loaded before the clock starts
client.prefetch(requests)
if setting == "together" and name != "fp32" and not merged["calls"]:
    sys.exit("no decode step rounded its writes at its end: this run would not measure the change")
print(json.dumps({"setting": setting, "merged_roundings": dict(merged), "prefill_s": round(spent["prefill"], 3),
                  "decode_s": round(spent["decode"], 3)}))
"""

WORKLOADS = {"lambada-10": REPO / "runs/bench/merged_head/lambada_requests.json", "pattern_match-10": STATE}
RUNS = [("fp32", "together"), ("8-bit-deployment", "together"), ("8-bit-deployment", "apart")]  # fp32: plain, in bf16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    command = f"python runs/compression_8bit/decode_paths/step_rounding_ab.py --rounds {args.rounds}"
    for workload, state in WORKLOADS.items():
        for r in range(args.rounds):
            for name, setting in RUNS[r % len(RUNS):] + RUNS[:r % len(RUNS)]:
                run_child(CHILD, name, [json.dumps(PATHS[name]), setting], 10, command,
                          HERE / "step_rounding_ab.jsonl", state=state, workload=workload, round=r)


if __name__ == "__main__":
    main()
