"""expert_first_call.py's question in a process of its own: OLMoE expert-shaped 4-bit weights
(8 experts' gate, up and down) dequantized and multiplied over 1040 rows, as the engine's
prefill does, and bare bf16 products on weights made up front, timed as the first call after
a dequantization, after another bare call, and after an engine-like call, in rounds for 40 s.

    python runs/bench/moe_decode_step/first_call_alone.py

Output: first_call_alone_2026-11-29.txt.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from flexgen_helm.compression.int4 import CompressedWeight, pack_int4
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.models.gated_mlp import gated_mlp
from flexgen_helm.policy.policy import Compression

DTYPE, ROWS, EXPERTS = torch.bfloat16, 1040, 8
SHAPES = ((1024, 2048), (1024, 2048), (2048, 1024))  # OLMoE's gate, up, down


def main() -> None:
    keep_freed_host_memory()  # as the engine runs
    packs = [[pack_int4(quantize(torch.randn(s).to(DTYPE), Compression(4, 64, 1), 1), torch.device("cpu"))
              for s in SHAPES] for _ in range(EXPERTS)]
    bare = [torch.randn(s).to(DTYPE) for s in SHAPES]
    x = torch.randn(ROWS, 2048).to(DTYPE)

    def dequantized(i: int) -> list:
        return [CompressedWeight([(0, p)], p.shape, DTYPE, max_kernel_rows=32).dense() for p in packs[i % EXPERTS]]

    def engine_like(i: int) -> None:
        gated_mlp(x, *dequantized(i), "silu")

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    totals = dict.fromkeys(("dequantization alone", "bare after a dequantization", "bare after a bare call",
                            "engine-like call", "bare after an engine-like call"), 0.0)
    rounds, end = 0, time.time() + 40
    while time.time() < end:
        rounds += 1
        totals["dequantization alone"] += timed(functools.partial(dequantized, rounds))
        totals["bare after a dequantization"] += timed(lambda: gated_mlp(x, *bare, "silu"))
        gated_mlp(x, *bare, "silu")
        totals["bare after a bare call"] += timed(lambda: gated_mlp(x, *bare, "silu"))
        totals["engine-like call"] += timed(functools.partial(engine_like, rounds))
        totals["bare after an engine-like call"] += timed(lambda: gated_mlp(x, *bare, "silu"))
    for key, seconds in totals.items():
        print(f"{key:32s} {seconds / rounds * 1e3:7.2f} ms")
    print(f"rounds {rounds}, load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
