"""How much of a main-job run goes to oneDNN building kernels for shapes it has not met: the
gap_parts.py child (the main job's saved requests through our client, bfloat16, SmolLM2 in RAM)
run with ONEDNN_VERBOSE=profile_create, its primitive creations summed (cache misses against
hits, their milliseconds), beside the run's prefill and decode seconds.

    python runs/bench/row_buckets/creation_time.py [--rounds 1] [--out FILE]

Each (workload, deployment) in its own process; appends one JSON line per run to --out
(default creation_time.jsonl beside this file).
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
sys.path.insert(0, str(REPO / "runs/compression_8bit/decode_paths"))
from gap_parts import CHILD, DEPLOYMENTS, WORKLOADS  # noqa: E402
from scenario_paths import PATHS  # noqa: E402


def creations(stderr: str) -> dict:
    """Summed oneDNN primitive creations of a run (profile_create lines): count and ms, by miss/hit."""
    out = {"cache_miss": [0, 0.0], "cache_hit": [0, 0.0]}
    for line in stderr.splitlines():
        parts = line.split(",")
        if len(parts) > 3 and parts[2] == "primitive" and parts[3].startswith("create:"):
            kind = parts[3].split(":")[1]
            out.setdefault(kind, [0, 0.0])
            out[kind][0] += 1
            out[kind][1] += float(parts[-1])
    return {f"{k}_count": v[0] for k, v in out.items()} | {f"{k}_ms": round(v[1], 1) for k, v in out.items()}


def main() -> None:
    from flexgen_helm.memory.machine import machine_label

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE / "creation_time.jsonl")
    args = p.parse_args()
    command = f"python runs/bench/row_buckets/creation_time.py --rounds {args.rounds}"
    for r in range(args.rounds):
        for workload, state in WORKLOADS.items():
            for name in DEPLOYMENTS:
                load = os.getloadavg()[0]
                env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
                done = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "runs/bench/merged_head"),
                                       str(state), "10", name, json.dumps(PATHS[name])],
                                      capture_output=True, text=True, cwd=REPO, env=env)
                if done.returncode:
                    sys.exit(f"{name}: the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
                timed = json.loads(done.stdout.strip().splitlines()[-1])
                record = {"round": r, "workload": workload, "deployment": {"fp32": "BF16"}.get(name, name),
                          "prefill": timed["prefill"], "decode": timed["decode"],
                          **creations(done.stderr + done.stdout), "host": machine_label(),
                          "loadavg_1m": round(load, 2), "command": command}
                print(json.dumps(record), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
