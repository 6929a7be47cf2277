"""Our bf16 products over a shared prefix's keys held by position (kv_heads, P, d), read as a
transposed view, against the same keys copied transposed (kv_heads, d, P), as the layout held
them before the decode call could run on torch's fused kernel (which needs them by position):
the scores' product q (kv_heads, m, d) @ keys^T at a decode step's shapes (3 kv heads, 96
queries, 1,000 keys) and a few-shot prefill window's (2,040 queries, 300 and 1,000 keys).
The same bits either way (asserted); medians of 300 calls, the two in turn, twice.

    python runs/prefix_sharing/decode_variants/keys_transposed_view.py
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from pathlib import Path

import torch

from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import interleaved_per_call


def main() -> None:
    torch.manual_seed(0)
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}")
    for m, keys in [(96, 1000), (2040, 300), (2040, 1000)]:
        q = torch.randn(3, m, 64).bfloat16()
        by_position = torch.randn(3, keys, 64).bfloat16()
        copied = by_position.transpose(1, 2).contiguous()
        calls = {"transposed copy": functools.partial(torch.bmm, q, copied),
                 "view": functools.partial(torch.bmm, q, by_position.transpose(1, 2))}
        assert torch.equal(calls["transposed copy"](), calls["view"]())
        times = interleaved_per_call(calls, calls=10, rounds=30, warmup=5)
        medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        print(f"{m:5} queries x {keys:5} keys: " + ", ".join(f"{n} {us:.0f} us" for n, us in medians.items())
              + f"; copy over view {medians['transposed copy'] / medians['view']:.3f}x")


if __name__ == "__main__":
    main()
