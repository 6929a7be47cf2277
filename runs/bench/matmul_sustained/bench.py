"""How fast this machine multiplies over a run's length, against the fastest call a profile
keeps: one bf16 product shape, called back to back for --seconds, each call timed. Prints the
fastest call's rate (what `flexgen-helm profile` kept up to format 6: planner/hardware_profile._timed), the
percentiles of the per-call rates, and the sustained rate (all FLOPs over all the time), overall
and per window of --window seconds. On a host whose products swing from moment to moment, the
sustained rate is what a minute-long row gets.

    python runs/bench/matmul_sustained/bench.py --rows 1024 --out 2048 --in 1024 --seconds 60

Appends one JSON line to runs/bench/matmul_sustained/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def host() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()}, {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--out", type=int, default=2048, help="the weight's output features")
    ap.add_argument("--in", dest="in_f", type=int, default=1024, help="the weight's input features")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.rows, args.in_f).to(dtype)
    w = torch.randn(args.out, args.in_f).to(dtype)
    flop = 2.0 * args.rows * args.in_f * args.out
    for _ in range(3):
        F.linear(x, w)
    load_before = os.getloadavg()[0]
    stamps, times = [], []
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t0 = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - t0)
        stamps.append(t0 - start)
    rates = sorted(flop / t / 1e9 for t in times)
    windows = {}
    for s, t in zip(stamps, times):
        bucket = windows.setdefault(int(s // args.window), [0.0, 0])
        bucket[0] += t
        bucket[1] += 1
    window_rates = [n * flop / busy / 1e9 for busy, n in windows.values()]
    row = {
        "host": host(), "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
        "rows": args.rows, "out": args.out, "in": args.in_f, "seconds": args.seconds, "calls": len(times),
        "fastest_call_gflop_s": round(rates[-1]), "p90_gflop_s": round(rates[int(0.9 * (len(rates) - 1))]),
        "median_gflop_s": round(statistics.median(rates)), "p10_gflop_s": round(rates[int(0.1 * (len(rates) - 1))]),
        "sustained_gflop_s": round(len(times) * flop / sum(times) / 1e9),
        f"per_{args.window:g}s_window_gflop_s": [round(r) for r in window_rates],
        "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(row))
    with open(Path(__file__).with_name("results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
