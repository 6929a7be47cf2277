"""What the benches under runs/bench that time rounds in one process share
(kivi_held_dense/slot_writes.py, pertoken_rewrite/rewrite.py): their arguments, and their result
appended as one JSON line with what it ran on (the host, the load average before and after, the
command); and the median time of a call, timed alone or in runs of many (read_rates/bench.py,
compression/kernel_crossover.py, runs/prefix_sharing/window_one_copy/window_vs_joined.py)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from flexgen_helm.memory.machine import machine_label


def bench_args(doc: str, here: Path, rounds: int) -> argparse.Namespace:
    """--threads (torch's, set here), --rounds (default `rounds`) and --out (default
    results.jsonl in `here`, the bench's folder); `doc`'s first line describes the bench."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--out", type=Path, default=here / "results.jsonl")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    return args


def append_record(out: Path, record: dict, load_before: float, command: str, **fields) -> None:
    """Prints record (with fields, the host, the load and the command added) and appends it to out."""
    record = {**record, **fields, "host": machine_label(),
              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "command": command}
    print(json.dumps(record))
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def median_per_call(fn, calls: int, rounds: int, warmup: int) -> float:
    """Seconds a call of fn, the median over `rounds` timings of `calls` calls each, after
    `warmup` untimed calls (calls too short to time one at a time: cache_step_costs.py,
    prefix_sharing/decode_variants/prefix_part_pieces.py)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def median_seconds(fn, rounds: int) -> float:
    """The median of `rounds` timed calls of fn, after one untimed (warm-up) call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_per_call(fns: dict, calls: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds a call of each fn, timed over `calls` calls, in `rounds` rounds of all of them
    in turn (the order reversed every other round), after `warmup` untimed calls of each: a
    noisy shared host's slow phases then fall on every fn alike, and round i's timings of two
    fns make a pair (prefix_sharing/decode_call_parts.py)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for i in range(rounds):
        for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            start = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            times[name].append((time.perf_counter() - start) / calls)
    return times
