"""A prefill window's attention, bf16, 58 rows x 3 kv heads x 3 query heads (SmolLM2's): the
prefix read as one copy (attention.attend_window_past_shared_prefix) against torch's fused
kernel over each row's joined columns (attention.attend), for (window, tail, one copy) sizes:
`window` own columns a row computes, `tail` prefix positions its padding pushed into its
columns, `one copy` the prefix positions every row holds. Median of 5 calls, ms.

    python runs/prefix_sharing/window_one_copy/window_vs_joined.py [--sizes 90,180,120 ...]

shared_prefix.ONE_COPY_MIN_POSITIONS and window_split's rule come from these numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from flexgen_helm.executor import attention
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import median_seconds

SIZES = ["90,180,120", "90,10,290", "50,50,100", "30,100,150", "90,60,160", "8,0,1000", "40,0,60"]


def one(window: int, tail: int, split: int) -> tuple[float, float]:
    torch.manual_seed(0)
    rows, kvh, r, d = 58, 3, 3, 64
    u, t = rows * kvh, tail + window
    q = torch.randn(u, r, window, d).bfloat16()
    k, v = torch.randn(u, t, d).bfloat16(), torch.randn(u, t, d).bfloat16()
    copy = attention.prefix_for_decode(torch.randn(kvh, split, d), torch.randn(kvh, split, d), torch.device("cpu"),
                                       torch.bfloat16)
    joined_k = torch.cat([torch.randn(u, split, d).bfloat16(), k], 1)
    joined_v = torch.cat([torch.randn(u, split, d).bfloat16(), v], 1)
    valid, joined_valid = torch.ones(u, t, dtype=torch.bool), torch.ones(u, split + t, dtype=torch.bool)
    return (median_seconds(lambda: attention.attend_window_past_shared_prefix(q, k, v, valid, copy), 5) * 1e3,
            median_seconds(lambda: attention.attend(q, joined_k, joined_v, joined_valid, causal=True), 5) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=SIZES, help="window,tail,one-copy triples")
    args = p.parse_args()
    keep_freed_host_memory()
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}")
    print("| window | tail | one copy | one copy + own (ms) | joined, fused (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        window, tail, split = map(int, size.split(","))
        ours, fused = one(window, tail, split)
        print(f"| {window} | {tail} | {split} | {ours:.2f} | {fused:.2f} |")


if __name__ == "__main__":
    main()
