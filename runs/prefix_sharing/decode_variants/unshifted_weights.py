"""The shared prefix's part of attention in bf16 (attention._bf16_prefix_part) with its weights
taken unshifted, as the engine now takes them where the scores allow, against the same part with
each row's peak taken out first (attention._shifted_bf16_prefix_part, its fallback: the code
every call ran before, unchanged). At a decode step's shapes (SmolLM2: 3 kv heads x 96 queries, 1,000 prefix
keys) and a few-shot prefill window's (300 prefix keys, 3,000 and 12,000 queries a kv head, in
the engine's slices of WINDOW_MAX_SCORES scores). Medians of timed calls, alternating the two,
and each one's largest difference from float64 attention.

    python runs/prefix_sharing/decode_variants/unshifted_weights.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from flexgen_helm.executor import attention
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import median_seconds

SHAPES = ((1000, 96, 200), (300, 3000, 20), (300, 12000, 10))  # prefix keys, queries a kv head, timed calls
KV_HEADS, HEAD_DIM = 3, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two ways per shape")
    args = p.parse_args()
    keep_freed_host_memory()
    torch.manual_seed(0)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"# {machine_label()}, load {load}: the bf16 prefix part, us (median), largest difference from float64")
    ways = {"unshifted (the engine's)": attention._bf16_prefix_part,
            "peak out (before; fallback)": attention._shifted_bf16_prefix_part}
    for keys, queries, calls in SHAPES:
        k, v = torch.randn(KV_HEADS, keys, HEAD_DIM) * 1.5, torch.randn(KV_HEADS, keys, HEAD_DIM)
        prefix = attention.prefix_for_decode(k, v, torch.device("cpu"), torch.bfloat16)
        q = torch.randn(KV_HEADS, queries, HEAD_DIM) * 1.5
        rows = max(1, attention.WINDOW_MAX_SCORES // (KV_HEADS * keys))
        exact = ((q.double() @ k.double().transpose(1, 2)) / math.sqrt(HEAD_DIM)).softmax(-1) @ v.double()
        def sliced(part, q=q, prefix=prefix, rows=rows, queries=queries):  # as the window path slices its queries
            return [part(q[:, a:a + rows], prefix) for a in range(0, queries, rows)]

        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, part in ways.items():
                times[name].append(median_seconds(lambda part=part: sliced(part), calls))
        for name, part in ways.items():
            out = torch.cat([o for o, _ in sliced(part)], 1)
            spread = ", ".join(f"{t * 1e6:.0f}" for t in times[name])
            print(f"{keys:5d} keys x {queries:6d} queries  {name:26s} {spread} us, "
                  f"largest difference {(out.double() - exact).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
