"""The main job's three 4-bit-relevant settings side by side, in one process (issue 17): the
bundled SmolLM2-135M uncompressed (bf16), with 4-bit weights only, and as the 4-bit HELM
deployment runs it (4-bit weights + 4-bit KIVI cache, flexgen/smollm2-135m-4bit), on a
HELM-sized batch (2 prompts of 95 tokens, 8 new tokens, as LAMBADA's batches in `flexgen-helm
demo -m 10`). The engines take turns, 2 warm-up rounds then 7 timed, so a noisy neighbour
hits all three alike; medians of the engine's own prefill and decode seconds.

    PYTHONPATH=. python runs/bench/compression/kv4_decode/smollm2_deployments.py [--json OUT]

The same against an older commit C (the "before" row of runs/bench/compression/int4/README.md):
    git worktree add /tmp/before C && PYTHONPATH=/tmp/before python \
        runs/bench/compression/kv4_decode/smollm2_deployments.py --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import flexgen_helm
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_info, machine_label
from flexgen_helm.policy.policy import Policy

W4 = {"bits": 4, "group_size": 64}
SETTINGS = {
    "bf16": {},
    "4-bit weights": {"compress_weight": W4},
    "4-bit weights + KIVI cache (the 4-bit deployment)": {
        "compress_weight": W4, "compress_cache": {**W4, "cache_grouping": "kivi"}},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=95)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default="runs/bench/compression/kv4_decode/smollm2_deployments.json")
    args = ap.parse_args()
    engines = {name: Engine.load("smollm2-135m", policy=Policy.from_dict(
        {"gpu_batch_size": args.batch, "num_gpu_batches": 1, **fields}), progress=False)
        for name, fields in SETTINGS.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True)
    load_start = os.getloadavg()[0]
    times = {name: [] for name in engines}
    for rnd in range(2 + args.rounds):
        for name, engine in engines.items():
            stats = engine.generate(prompts, params).stats
            if rnd >= 2:
                times[name].append((stats.prefill_s, stats.decode_s))
    rows = []
    base = None
    for name, ts in times.items():
        prefill, decode = (statistics.median(t[i] for t in ts) for i in (0, 1))
        base = base or (prefill, decode)
        rows.append({"setting": name, "prefill_s": prefill, "decode_s": decode,
                     "decode_step_ms": 1000 * decode / max(1, args.gen_len - 1),
                     "time_vs_bf16": (prefill + decode) / sum(base)})
    out = {"host": machine_label(), "machine": machine_info(), "node": platform.node(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "command": " ".join(["python", *sys.argv]),
           # the engine measured: the commit of the flexgen_helm this process imported (a run
           # against an older commit puts that checkout first on PYTHONPATH)
           "flexgen_helm": {"path": str(Path(flexgen_helm.__file__).parent), "commit": _commit_of(flexgen_helm)},
           "workload": vars(args), "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
           "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{out['host']}; load {load_start:.2f} -> {out['load_average_end']:.2f}")
    for r in rows:
        print(f"{r['setting']:52s} prefill {r['prefill_s']:.3f} s  decode {r['decode_s']:.3f} s "
              f"({r['decode_step_ms']:.1f} ms/step)  time {r['time_vs_bf16']:.2f}x bf16")


def _commit_of(package) -> str:
    where = Path(package.__file__).parent
    head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."],
                           capture_output=True, text=True)
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    main()
