"""A HELM scenario's requests through our client at two checkouts, rounds interleaved: what a
change to the engine gains on the requests HELM users send (their own stop points, so GPU
batches thin out as sequences finish).

    git worktree add /tmp/before <commit>
    python runs/bench/merged_head/scenario_ab.py --state <scenario_state.json> \
        --trees /tmp/before . --rounds 3 --out runs/bench/merged_head/pattern_match_ab.jsonl

Or `--block GBS NB PROMPT GEN` in place of `--state`: the engine alone, GBS x NB random prompts
of PROMPT tokens and GEN new tokens each, in that block (FlexGen's many small GPU batches).

`--state`: a HELM run's scenario_state.json (its requests are taken as they are, sent to the
deployment flexgen/smollm2-135m in float32); e.g. the one `python -m
flexgen_helm.tools.compare.helm_clients --systems ours-float32 --scenarios
synthetic_reasoning-pattern_match` leaves under its --out folder's helm_output. Each round runs
every tree once, each in its own process (PYTHONPATH=tree), the scenario planned and run as
the BatchingExecutor does (FlexGenClient.prefetch, no HELM cache), and records the seconds
spent in the block schedule's prefill and decode calls and the wall time. Appends a JSON line
per round and tree to --out, with the host, the commit and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
from flexgen_helm.executor import schedule

spent = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
def timed(name, fn):
    def run(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            spent[name + "_s"] += time.perf_counter() - t0
            spent["decode_steps"] += name == "decode"
    return run
schedule.BlockSchedule.prefill = timed("prefill", schedule.BlockSchedule.prefill)
schedule.BlockSchedule.decode = timed("decode", schedule.BlockSchedule.decode)

sys.path.insert(0, sys.argv[2])  # this bench's folder: scenario_client.py
from scenario_client import float32_client, scenario_requests
requests = scenario_requests(sys.argv[1])
client = float32_client()
t0 = time.perf_counter()
computed = client.prefetch(requests)
import flexgen_helm
print(json.dumps({**spent, "wall_s": time.perf_counter() - t0, "requests": computed, "code": flexgen_helm.__file__}))
"""


# --block GBS NB PROMPT GEN: the engine alone on GBS x NB random prompts of PROMPT tokens, GEN
# new tokens each (none stops early), in that block, weights and cache in RAM, float32
BLOCK_CHILD = r"""
import json, sys, time
import torch
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy

gbs, nb, prompt, gen = map(int, sys.argv[1:5])
engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=gbs, num_gpu_batches=nb), dtype="float32",
                     device="cpu", progress=False)
g = torch.Generator().manual_seed(0)
prompts = torch.randint(100, 40000, (gbs * nb, prompt), generator=g).tolist()
engine.generate(prompts[:gbs * nb], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
run = engine.generate(prompts, SamplingParams(max_new_tokens=gen, ignore_eos=True))
s = run.stats
import flexgen_helm
print(json.dumps({"prefill_s": s.prefill_s, "decode_s": s.decode_s, "decode_steps": gen - 1,
                  "block": [gbs, nb, prompt, gen], "code": flexgen_helm.__file__}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--state")
    what.add_argument("--block", type=int, nargs=4, metavar=("GBS", "NB", "PROMPT", "GEN"))
    p.add_argument("--trees", nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from flexgen_helm.memory.machine import machine_label

    for tree in args.trees:
        if not (Path(tree) / "flexgen_helm").is_dir():
            raise SystemExit(f"{tree}: not a checkout of flexgen-helm (no flexgen_helm/ in it)")
    for r in range(args.rounds):
        for tree in args.trees:
            load = os.getloadavg()[0]
            root = Path(tree).resolve()
            env = {**os.environ, "PYTHONPATH": str(root)}
            here = str(Path(__file__).resolve().parent)  # scenario_client.py, for the child
            child = ([CHILD, str(Path(args.state).resolve()), here] if args.state
                     else [BLOCK_CHILD, *map(str, args.block)])
            # run in the tree: `python -c` puts its working directory ahead of PYTHONPATH
            done = subprocess.run([sys.executable, "-c", *child], env=env, cwd=root, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{tree}: the run failed:\n{done.stderr[-3000:]}")
            code = json.loads(done.stdout.strip().splitlines()[-1])["code"]
            if not Path(code).resolve().is_relative_to(root):
                raise SystemExit(f"{tree}: the run imported flexgen_helm from {code}, not from this tree")
            commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
            row = {"round": r, "tree": tree, "commit": commit, **json.loads(done.stdout.strip().splitlines()[-1]),
                   "host": machine_label(), "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
                   "state": args.state, "command": " ".join(sys.argv)}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
