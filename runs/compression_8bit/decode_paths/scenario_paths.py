"""The main job's few-shot scenario through our client under each compression path: where a
compressed deployment's time goes when its sequences stop at their own points (the main job's
pattern_match: of 10 requests, most stop within a few tokens, some run to 50).

    python runs/compression_8bit/decode_paths/scenario_paths.py [--requests 10] [--rounds 3] [--paths ...] [--out FILE]

The first --requests of a HELM run's saved pattern_match requests
(runs/bench/merged_head/pattern_match_requests.json), float32, SmolLM2 in RAM, through our
client (planned as the BatchingExecutor plans them). Paths: the main job's deployments
(helm/model_deployments.yaml: fp32, 8-bit, 4-bit) and the 4-bit one's two halves (weights
alone, KIVI cache alone). Each round runs every path once, each in its own process (the
client answers a request it has computed from memory), and records the seconds spent in the
block schedule's prefill and decode calls. Appends one JSON line per run to --out (default
scenario_paths.jsonl beside this file), with the host and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
STATE = REPO / "runs/bench/merged_head/pattern_match_requests.json"
W4 = {"bits": 4, "group_size": 32, "method": "gguf"}
KIVI = {"bits": 4, "group_size": 64, "cache_grouping": "kivi"}
PATHS = {  # name -> the deployment's policy (helm/model_deployments.yaml)
    "fp32": {},
    "8-bit-deployment": {"compress_weight": {"bits": 8, "group_size": -1},
                         "compress_cache": {"bits": 8, "group_size": 64, "cache_grouping": "per-token"}},
    "4-bit-deployment": {"compress_weight": W4, "compress_cache": KIVI},
    "4-bit-weights-only": {"compress_weight": W4},
    "kivi-cache-only": {"compress_cache": KIVI},
}

# a child's first lines: the saved requests' reader, and seconds in the block schedule's
# prefill and decode counted in `spent` (the rest of each child follows)
TIMED_CHILD_HEAD = r"""
import json, sys, time, collections
sys.path.insert(0, sys.argv[1])
from scenario_client import scenario_requests
from helm.common.cache import BlackHoleCacheConfig
from flexgen_helm.executor import schedule
from flexgen_helm.helm.client import FlexGenClient

spent = collections.Counter()
for name in ("prefill", "decode"):
    fn = getattr(schedule.BlockSchedule, name)
    def timed(self, *a, _fn=fn, _name=name, **k):
        t0 = time.perf_counter()
        try:
            return _fn(self, *a, **k)
        finally:
            spent[_name] += time.perf_counter() - t0
    setattr(schedule.BlockSchedule, name, timed)
requests = scenario_requests(sys.argv[2])[:int(sys.argv[3])]
"""

CHILD = TIMED_CHILD_HEAD + r"""
name, policy = sys.argv[4], json.loads(sys.argv[5])
client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment=f"flexgen/smollm2-135m-{name}",
                       dtype="float32", **({"policy": policy} if policy else {}))
_ = client.handle  # loaded before the clock starts
client.prefetch(requests)
print(json.dumps({"prefill_s": round(spent["prefill"], 3), "decode_s": round(spent["decode"], 3)}))
"""


def run_child(child: str, name: str, child_args: list[str], requests: int, command: str, out: Path,
              state: Path = STATE, **fields) -> dict:
    """Runs `child` for one path (argv: the request file's folder, the saved requests (`state`), how many,
    the path's name, then child_args) in its own process, and appends its record to `out`: the
    child's last stdout line (JSON) after `fields`, with the host, the load before and after, and
    the command. A child that fails stops the run with its error."""
    from flexgen_helm.memory.machine import machine_label

    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, "-c", child, str(REPO / "runs/bench/merged_head"), str(state),
                           str(requests), name, *child_args], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        sys.exit(f"{name}: the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = {**fields, "path": name, **json.loads(done.stdout.strip().splitlines()[-1]), "requests": requests,
              "host": machine_label(), "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
              "command": command}
    print(json.dumps(record), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--out", type=Path, default=HERE / "scenario_paths.jsonl")
    args = p.parse_args()
    command = (f"python runs/compression_8bit/decode_paths/scenario_paths.py --requests {args.requests} "
               f"--rounds {args.rounds} --paths {' '.join(args.paths)}")
    for r in range(args.rounds):
        for name in args.paths:
            run_child(CHILD, name, [json.dumps(PATHS[name])], args.requests, command, args.out, round=r,
                      code=str(REPO))


if __name__ == "__main__":
    main()
