"""A decode's cache stores, BF16 against the main job's 8-bit deployment (8-bit weights per
channel with their dense copies kept; an 8-bit per-token cache held dense, so each step's new
position is rounded as it is stored): SmolLM2, 10 prompts of a shared 180-token prefix and
40-59 of their own (pattern_match-like), 25 new tokens, each deployment in a fresh process,
alternating for --rounds. Prints each run's decode seconds and its decode timers.

    python runs/compression_8bit/generate_timers/decode_store.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

CHILD = "--child"


def child(name: str) -> None:
    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.memory.host_allocator import keep_freed_host_memory
    from flexgen_helm.planner.hardware_profile import use_profile
    from flexgen_helm.policy import Policy
    from flexgen_helm.policy.policy import PER_CHANNEL, Compression

    keep_freed_host_memory()
    use_profile()
    policy = Policy(gpu_batch_size=64)
    if name == "8-bit":
        policy = Policy(gpu_batch_size=64, compress_weight=Compression(8, PER_CHANNEL),
                        compress_cache=Compression(8, 64, cache_grouping="per-token"), keep_dense_weights=True,
                        keep_dense_cache=True)
    engine = Engine.load("smollm2-135m", policy, progress=False)
    rng = random.Random(0)
    prefix = [rng.randrange(10, 40000) for _ in range(180)]
    prompts = [prefix + [rng.randrange(10, 40000) for _ in range(rng.randrange(40, 60))] for _ in range(10)]
    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    run = engine.generate(prompts, params)
    print(json.dumps({"deployment": name, "decode_s": round(run.stats.decode_s, 3),
                      "timers": {k: round(v, 3) for k, v in run.stats.timers.items() if k.startswith("decode")}}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == CHILD:
        child(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from flexgen_helm.memory.machine import machine_label

    print(f"# {machine_label()}")
    for _ in range(args.rounds):
        for name in ("bf16", "8-bit"):
            load = os.getloadavg()[0]
            done = subprocess.run([sys.executable, __file__, CHILD, name], capture_output=True, text=True, check=True)
            print(done.stdout.strip().splitlines()[-1][:-1] + f', "loadavg_1m": {load:.2f}}}')


if __name__ == "__main__":
    main()
