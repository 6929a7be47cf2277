"""What the dense copies made at load leave in the heap, and what the prefills after pay for it.

    python runs/compression_8bit/load_holes/bench.py [--rounds 4] [--calls 3] [--out FILE]

The main job's three SmolLM2 deployments (BF16; 8-bit per channel and 4-bit from the GGUF's
codes, each with its dense copies kept across blocks, as the planner chose them in the main
job), each in a fresh process of its own, as a HELM run loads one, the deployments alternating
round by round. Per process: the load's seconds; after it, the anonymous resident memory and
the heap's free chunks (holes: mallinfo2's fordblks); then --calls prefills of a
LAMBADA-sized block (10 prompts of 60-89 tokens, one new token each): each call's seconds and
the seconds its schedule spent handing freed memory back (RunStats timer
"release_freed_memory"). Appends one JSON line per process to --out (default: results.jsonl
beside this file), with the host, the commit and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEPLOYMENTS = ("bf16", "8-bit", "4-bit")


def policy_of(name: str):
    from flexgen_helm.policy import Policy
    from flexgen_helm.policy.policy import PER_CHANNEL, Compression

    block = dict(gpu_batch_size=64, num_gpu_batches=1)
    if name == "bf16":
        return Policy(**block)
    weights, cache = {"8-bit": (Compression(8, PER_CHANNEL), Compression(8, 64, cache_grouping="per-token")),
                      "4-bit": (Compression(4, 32, method="gguf"), Compression(4, 64, cache_grouping="kivi"))}[name]
    return Policy(**block, compress_weight=weights, compress_cache=cache, keep_dense_weights=True,
                  keep_dense_cache=True)


def one_process(name: str, calls: int) -> dict:
    """The measurements of one deployment, loaded in this process."""
    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.memory.host_allocator import heap_free_bytes
    from flexgen_helm.memory.usage import resident_anonymous_bytes
    from flexgen_helm.planner.hardware_profile import use_profile

    use_profile()
    start = time.perf_counter()
    engine = Engine.load("smollm2-135m", policy_of(name), progress=False)
    row = {"deployment": name, "load_s": time.perf_counter() - start,
           "rss_anon_after_load_mb": resident_anonymous_bytes() / 1e6,
           "heap_holes_after_load_mb": heap_free_bytes() / 1e6}
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 40000) for _ in range(rng.randrange(60, 90))] for _ in range(10)]
    row["call_s"], row["hand_back_s"] = [], []
    for _ in range(calls):
        start = time.perf_counter()
        run = engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
        row["call_s"].append(time.perf_counter() - start)
        row["hand_back_s"].append(run.stats.timers.get("release_freed_memory", 0.0))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results.jsonl")
    p.add_argument("--label", default="", help="what the record measured")
    p.add_argument("--child", choices=DEPLOYMENTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_process(args.child, args.calls)))
        return
    from flexgen_helm.memory.machine import machine_label

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    with args.out.open("a") as out:
        for r in range(args.rounds):
            for name in DEPLOYMENTS:
                load = os.getloadavg()[0]
                child = subprocess.run([sys.executable, __file__, "--child", name, "--calls", str(args.calls)],
                                       capture_output=True, text=True, check=True)
                row = json.loads(child.stdout.strip().splitlines()[-1])
                row.update(round=r, host=machine_label(), commit=commit, label=args.label, loadavg_1m=load)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"{name:6s} load {row['load_s']:.2f} s, holes {row['heap_holes_after_load_mb']:.0f} MB, calls "
                      + " ".join(f"{c * 1e3:.0f}" for c in row["call_s"]) + " ms, hand-backs "
                      + " ".join(f"{h * 1e3:.0f}" for h in row["hand_back_s"]) + " ms")


if __name__ == "__main__":
    main()
