"""A weight stored by row against the same weight stored by column (a transposed view: a packed
weight's dense copy made for a prefill, compression/int4.py), each multiplied both ways
(F.linear: x W^T; flipped: W x^T), at decode and prefill row counts.

    python runs/bench/linear_orientation/by_column.py [--rows 4 10 16 64 780] [--rounds 3]

SmolLM2's gate_proj shape (1536 x 576, float32), 40 distinct weights a pass (141 MB, more than
the caches hold). Per row count and way, the median over rounds of the mean milliseconds a
product, the ways interleaved within each round. Appends one JSON line to by_column.jsonl
beside this file, with the host, the command and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.dense_linear import flipped_linear
from flexgen_helm.memory.machine import machine_label

HERE = Path(__file__).resolve().parent


def mean_ms(product, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    for w in weights[:3]:
        product(x, w)
    start = time.perf_counter()
    for w in weights:
        product(x, w)
    return (time.perf_counter() - start) / len(weights) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4, 10, 16, 64, 780])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    g = torch.Generator().manual_seed(0)
    by_row = [torch.randn(1536, 576, generator=g) for _ in range(40)]
    by_column = [w.t().contiguous().t() for w in by_row]
    ways = {f"{layout}, {name}": (product, weights)
            for layout, weights in (("by row", by_row), ("by column", by_column))
            for name, product in (("F.linear", F.linear), ("flipped", flipped_linear))}
    results = {}
    for rows in args.rows:
        x = torch.randn(rows, 576, generator=g)
        times = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, (product, weights) in ways.items():
                times[way].append(mean_ms(product, x, weights))
        results[rows] = {way: round(statistics.median(t), 3) for way, t in times.items()}
        print(rows, results[rows], flush=True)
    record = {"host": machine_label(), "dtype": "float32", "ms_per_product": results,
              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "command": "python runs/bench/linear_orientation/by_column.py --rows "
                         f"{' '.join(map(str, args.rows))} --rounds {args.rounds}"}
    with open(HERE / "by_column.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
