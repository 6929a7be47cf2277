"""Packed bf16 weights on and off (FLEXGEN_HELM_PACKED_WEIGHTS), a decode step's time, rounds
alternating, each run in its own process.

    python runs/bench/packed_linear/decode_ab.py [--rounds 3]

Two workloads: the main job's first 10 pattern_match requests through our client (bf16,
SmolLM2, as runs/compression_8bit/decode_paths/scenario_paths.py's child runs them in float32),
seconds in the block schedule's decode; and a random 4-layer OLMoE GGUF at full layer size
(`python -m flexgen_helm.tools.compare.random_moe_gguf --geometry olmoe-1b-7b --layers 4 --out
/tmp/llamacpp-moe/olmoe-4l-bf16.gguf`), 32 prompts of 128 tokens, the mean decode step over 8
steps (2 and 10 new tokens, differenced). Appends one JSON line per run to decode_ab.jsonl
beside this file, with the host and the load average. Fails if the GGUF is missing.
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
GGUF = Path("/tmp/llamacpp-moe/olmoe-4l-bf16.gguf")

SCENARIO = r"""
import collections, json, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from scenario_client import scenario_requests
from scenario_paths import STATE
from helm.common.cache import BlackHoleCacheConfig
from flexgen_helm.executor import schedule
from flexgen_helm.helm.client import FlexGenClient
spent = collections.Counter()
fn = schedule.BlockSchedule.decode
def timed(self, *a, **k):
    t0 = time.perf_counter()
    try:
        return fn(self, *a, **k)
    finally:
        spent["decode"] += time.perf_counter() - t0
schedule.BlockSchedule.decode = timed
client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment="flexgen/smollm2-135m-ab",
                       dtype="bfloat16")
_ = client.handle
client.prefetch(scenario_requests(str(STATE))[:10])
print(json.dumps({"decode_s": round(spent["decode"], 4)}))
"""

MOE = r"""
import json, random, sys
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy
path = sys.argv[1]
engine = Engine.load(path, Policy(gpu_batch_size=32, num_gpu_batches=1), path=path, dtype="bfloat16", progress=False)
rng = random.Random(0)
prompts = [[rng.randrange(10, 50000) for _ in range(128)] for _ in range(32)]
engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
d = [engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True)).stats.decode_s for n in (2, 10)]
print(json.dumps({"decode_step_s": round((d[1] - d[0]) / 8, 4)}))
"""


def run(child: str, args: list[str], setting: str) -> dict:
    env = dict(os.environ, FLEXGEN_HELM_PACKED_WEIGHTS=setting)
    done = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode:
        sys.exit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from flexgen_helm.memory.machine import machine_label

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not GGUF.exists():
        sys.exit(f"{GGUF} is missing: write it first (this file's docstring has the command)")
    workloads = {"pattern_match-10": (SCENARIO, [str(REPO / "runs/bench/merged_head"),
                                                 str(REPO / "runs/compression_8bit/decode_paths")]),
                 "olmoe-4l-b32": (MOE, [str(GGUF)])}
    for name, (child, child_args) in workloads.items():
        for r in range(args.rounds):
            for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):
                load = os.getloadavg()[0]
                record = {"workload": name, "round": r, "packed": setting, **run(child, child_args, setting),
                          "host": machine_label(), "loadavg_1m": load,
                          "command": f"python runs/bench/packed_linear/decode_ab.py --rounds {args.rounds}"}
                print(json.dumps(record), flush=True)
                with (HERE / "decode_ab.jsonl").open("a") as f:
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
