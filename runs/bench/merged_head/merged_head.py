"""A decode step's head: each GPU batch's rows through the vocabulary-wide weight apart, against
all of them at once (executor/schedule.BlockSchedule._merged_decode_head), and the product cut
into slices of the vocabulary.

    python runs/bench/merged_head/merged_head.py [--model smollm2-135m] [--rounds 3]

The head as a generation step computes it: the product, then the log-softmax in float32, in
float32. Per split of the rows into GPU batches (e.g. 16+17: two batches), per way, the median
over rounds of the milliseconds the step's head calls take together, the ways interleaved
within each round:
- "apart, F.linear" / "apart, flipped": one call per GPU batch (x W^T, or W x^T as dense_linear
  takes it at decode row counts where the profile chose it);
- "merged, ...": one call for all the rows;
- "merged, flipped, slices of N": W x^T for N rows of W at a time, the slices' outputs
  concatenated.
Appends one JSON line to results.jsonl beside this file, with the host, the command and the load
average before and after.
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
HEADS = {"smollm2-135m": (49152, 576), "opt-1.3b": (50272, 2048)}  # (vocabulary, hidden)
SPLITS = ["8+8", "16+17", "32+32", "50+50", "64+64", "32+32+32+32"]


def sliced(rows: int):
    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.mm(part, x.t()) for part in w.split(rows)]).t()
    return product


def head_ms(product, xs: list[torch.Tensor], w: torch.Tensor, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        for x in xs:
            F.log_softmax(product(x, w), dim=-1, dtype=torch.float32)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(HEADS), default="smollm2-135m")
    p.add_argument("--splits", nargs="+", default=SPLITS)
    p.add_argument("--slices", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    g = torch.Generator().manual_seed(0)
    vocab, hidden = HEADS[args.model]
    w = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    products = {"F.linear": F.linear, "flipped": flipped_linear}
    products.update({f"flipped, slices of {n}": sliced(n) for n in args.slices})
    results = {}
    for split in args.splits:
        sizes = [int(n) for n in split.split("+")]
        apart = [torch.randn(n, hidden, generator=g) for n in sizes]
        merged = [torch.cat(apart)]
        ways = {f"apart, {name}": (product, apart) for name, product in products.items() if "slices" not in name}
        ways.update({f"merged, {name}": (product, merged) for name, product in products.items()})
        for product, xs in ways.values():  # warm-up
            head_ms(product, xs, w, 1)
        times = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, (product, xs) in ways.items():
                times[way].append(head_ms(product, xs, w, args.repeats))
        results[split] = {way: round(statistics.median(t), 2) for way, t in times.items()}
        print(split, results[split], flush=True)
    record = {"host": machine_label(), "model": args.model, "head": [vocab, hidden], "dtype": "float32",
              "ms_per_step_head": results, "threads": torch.get_num_threads(),
              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "command": f"python runs/bench/merged_head/merged_head.py --model {args.model} --splits "
                         f"{' '.join(args.splits)} --slices {' '.join(map(str, args.slices))} "
                         f"--rounds {args.rounds} --repeats {args.repeats}"}
    with open(HERE / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
