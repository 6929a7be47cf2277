"""How torch's CPU int4 kernel charges for rows: an OLMoE expert's 1024 x 2048 weight at 1-12
activation rows (one weight called again and again), then a decode step's layer as the engine
meets it: 192 products of different weights (64 experts x gate, up, down), each with the rows a
block of 32 sequences sends an expert (Poisson of mean 4, at least 1), the weights either all
different (their 200 MB from memory) or one weight 192 times (from the caches).

    python runs/bench/int4_rows/tiles.py
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from record import median_seconds

N, K, GROUP = 1024, 2048, 64
CALLS_A_LAYER = 192


def random_packed() -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (N, K), dtype=torch.int32)
    return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2),
            torch.randn(K // GROUP, N, 2).bfloat16().contiguous())


def decode_layer() -> tuple[list, list[torch.Tensor]]:
    """A decode layer's CALLS_A_LAYER weights and the rows each multiplies (Poisson of mean 4, at least 1)."""
    counts = torch.poisson(torch.full((CALLS_A_LAYER,), 4.0)).clamp(min=1).int().tolist()
    return [random_packed() for _ in range(CALLS_A_LAYER)], [torch.randn(c, K).bfloat16() for c in counts]


def main() -> None:
    torch.manual_seed(0)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; a {N} x {K} weight, groups of {GROUP}")
    packed, scales = random_packed()
    print("rows | us a call (median of 200)")
    for rows in range(1, 13):
        x = torch.randn(rows, K).bfloat16()
        print(f"{rows:4d} | {1e6 * median_seconds(functools.partial(mm, x, packed, GROUP, scales), 200):.0f}")
    weights, xs = decode_layer()

    def layer(ws) -> None:
        for (p, s), x in zip(ws, xs):
            mm(x, p, GROUP, s)

    rows = sum(len(x) for x in xs)
    print(f"a layer's {CALLS_A_LAYER} products, {rows} rows in all | ms (median of 10) | us a row")
    for name, ws in (("different weights", weights), ("one weight", weights[:1] * CALLS_A_LAYER)):
        t = 1e3 * median_seconds(functools.partial(layer, ws), 10)
        print(f"{name} | {t:.1f} | {1e3 * t / rows:.1f}")


if __name__ == "__main__":
    main()
