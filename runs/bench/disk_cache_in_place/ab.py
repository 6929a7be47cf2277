"""A plan's decode with the engine of two commits, rounds alternating, each run its own
`flexgen-helm bench` process: what reading the disk tier's KV cache in place changed.

    python runs/bench/disk_cache_in_place/ab.py --base 104bc52~1 --policy POLICY.json [--rounds 2]

`--base` is checked out into a git worktree under /tmp and run from there (PYTHONPATH first);
the other side is this checkout. The workload is the OLMoE-1B-7B compare row's: dummy bf16
weights, prompt 512 / gen 32, the 1.5 GiB pool + 4 GiB RAM, the offload folder of
`flexgen-helm compare`. Appends one JSON line per run to ab.jsonl beside this file (the host,
the load average, each run's decode step and its parts per step) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
STEPS = 31  # decode steps of gen 32 (the first token comes with the prefill)
PARTS = ("decode_compute", "decode_unpack_cache", "decode_attention", "wait_load_cache", "wait_load_hidden")


def bench(tree: Path, policy: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "flexgen_helm", "bench", "--model", "allenai/olmoe-1b-7b-0924", "--dummy",
           "--dtype", "bfloat16", "--device", "cpu", "--prompt-len", "512", "--gen-len", "32",
           "--gpu-mem", "1.5GiB", "--cpu-mem", "4GiB", "--offload-dir", "/tmp/flexgen-helm-compare/offload",
           "--policy", str(policy), "--warmup", "0", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the run from {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    from flexgen_helm.memory.machine import machine_label

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the commit to compare this checkout with")
    p.add_argument("--policy", type=Path, required=True, help="a policy JSON (a compare row's)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not args.policy.is_file():
        sys.exit(f"no policy file {args.policy}")
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True)
    if base.returncode:
        sys.exit(f"not a commit: {args.base}")
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "flexgen_helm"], cwd=REPO, capture_output=True, text=True)
    sides = {f"base {base.stdout.strip()}": None,
             f"this {here.stdout.strip()}{' (modified)' if dirty.stdout.strip() else ''}": REPO}
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), args.base], cwd=REPO, check=True)
        try:
            rows = []
            for r in range(args.rounds):
                for side, tree in sides.items():
                    load = os.getloadavg()[0]
                    got = bench(tree or worktree, args.policy.resolve(), Path(tmp) / "run.json")
                    t = got["timers"]
                    row = {"side": side, "round": r, "host": machine_label(), "load_before": round(load, 2),
                           "policy": got["policy_summary"], "tok_s": round(got["total_throughput"], 3),
                           "prefill_s": round(got["prefill_latency_s"], 2),
                           "decode_step_ms": round(1000 * got["decode_latency_s"] / STEPS),
                           **{f"{k}_ms": round(1000 * t.get(k, 0.0) / STEPS) for k in PARTS},
                           "peak_rss_gib": round(got["memory"]["cpu_peak_rss_bytes"] / 2**30, 2)}
                    rows.append(row)
                    with open(HERE / "ab.jsonl", "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO)


if __name__ == "__main__":
    main()
