"""What our client spends before a scenario's first batch (the tokenizer's load and the block's
plan), at two checkouts, rounds interleaved.

    git worktree add /tmp/before <commit>
    python runs/bench/plan_time/plan_ab.py --trees /tmp/before . --rounds 3 \
        --out runs/bench/plan_time/plan_ab.jsonl

Each round runs, for every tree and deployment (the main job's: fp32, 8bit, 4bit), one process
whose path starts with the tree: it loads our client for flexgen/smollm2-135m-<deployment> in
float32 with the arguments model_deployments.yaml gives it (the engine's load, timed apart),
then times the tokenizer's first load and `FlexGenClient.plan` on the 100 requests of a HELM
pattern_match run (runs/bench/merged_head/pattern_match_requests.json: few-shot, one shared
prefix), which is
what a helm-run spends between HELM handing over a scenario and our first batch. The tokenizer
is loaded from the cache folder the GGUF's first load wrote (~/.cache/flexgen-helm), as in
every helm-run after the first. Appends a JSON line per run to --out, with the host, the tree's
commit and the load average.
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
DEPLOYMENTS = ("fp32", "8bit", "4bit")  # flexgen/smollm2-135m, -8bit, -4bit

CHILD = r"""
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from scenario_client import scenario_requests
from helm.common.cache import BlackHoleCacheConfig
from flexgen_helm.helm.client import FlexGenClient

import yaml
from pathlib import Path
import flexgen_helm.helm

name = "flexgen/smollm2-135m" + ("" if sys.argv[4] == "fp32" else f"-{sys.argv[4]}")
listed = yaml.safe_load((Path(flexgen_helm.helm.__file__).parent / "model_deployments.yaml").read_text())
(args,) = [d["client_spec"]["args"] for d in listed["model_deployments"] if d["name"] == name]
requests = [r.__class__(**{**r.__dict__, "model": name, "model_deployment": name})
            for r in scenario_requests(sys.argv[3])]
t0 = time.perf_counter()
client = FlexGenClient(BlackHoleCacheConfig(), **{**args, "dtype": "float32"})
handle = client.handle
t1 = time.perf_counter()
handle.tokenizer
t2 = time.perf_counter()
plan = client.plan(client.unique_requests(requests), set())
t3 = time.perf_counter()
import flexgen_helm
print(json.dumps({"engine_load_s": round(t1 - t0, 3), "tokenizer_s": round(t2 - t1, 3),
                  "plan_s": round(t3 - t2, 3), "before_first_batch_s": round(t3 - t1, 3),
                  "batches": len(plan.batches), "policy": str(plan.policy), "module": flexgen_helm.__file__}))
"""


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", type=Path, nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=DEPLOYMENTS)
    p.add_argument("--out", type=Path, default=HERE / "plan_ab.jsonl")
    args = p.parse_args()
    from flexgen_helm.memory.machine import machine_label

    command = ("python runs/bench/plan_time/plan_ab.py --trees " + " ".join(map(str, args.trees))
               + f" --rounds {args.rounds} --deployments {' '.join(args.deployments)}")
    for r in range(args.rounds):
        for deployment in args.deployments:
            for tree in args.trees:
                load = os.getloadavg()[0]
                done = subprocess.run([sys.executable, "-c", CHILD, str(tree.resolve()),
                                       str(REPO / "runs/bench/merged_head"), str(STATE), deployment],
                                      capture_output=True, text=True, cwd=tree)
                if done.returncode:
                    sys.exit(f"{tree} {deployment}: the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                if not Path(got.pop("module")).resolve().is_relative_to(tree.resolve()):
                    sys.exit(f"{tree}: the child imported flexgen_helm from elsewhere")
                record = {"round": r, "tree": str(tree), "commit": commit_of(tree), "deployment": deployment, **got,
                          "host": machine_label(), "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
                          "command": command}
                print(json.dumps(record), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
