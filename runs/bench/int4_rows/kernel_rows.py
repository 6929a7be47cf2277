"""What one OLMoE expert's product costs at a decode step's row counts, by path: torch's int4
kernel (the CPU layout, groups of 64), the int8 kernel (per output channel) and bf16 F.linear,
on one 1024 x 2048 weight called again and again (so its bytes come from the CPU's caches:
the kernels' compute, not memory, is what is timed), and memcpy of 64 MB for the memory's rate.
Medians of 200 calls after one of warm-up (runs/bench/record.py); prints the host and the load.

    python runs/bench/int4_rows/kernel_rows.py
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

CALLS = 200
N, K, GROUP = 1024, 2048, 64  # an OLMoE expert's gate (or up) projection: 2048 -> 1024


def main() -> None:
    torch.manual_seed(0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 2)
    scales_zeros = torch.randn(K // GROUP, N, 2).bfloat16().contiguous()
    w8, s8 = torch.randint(-128, 127, (N, K), dtype=torch.int8), torch.randn(N).bfloat16()
    w16 = torch.randn(N, K).bfloat16()
    big = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(big)
    int4_bytes = N * K // 2 + scales_zeros.numel() * 2
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; a {N} x {K} weight")
    print(f"memcpy 64 MB: {64 / 1024 / median_seconds(lambda: dst.copy_(big), 20):.1f} GB/s copied")
    print("rows | int4 kernel ms (GB/s of its bytes) | int8 kernel ms (GB/s) | bf16 F.linear ms (GB/s)")
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, K).bfloat16()
        int4_mm = functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, x, packed, GROUP, scales_zeros)
        t4 = 1e3 * median_seconds(int4_mm, CALLS)
        t8 = 1e3 * median_seconds(functools.partial(torch.ops.aten._weight_int8pack_mm, x, w8, s8), CALLS)
        t16 = 1e3 * median_seconds(functools.partial(torch.nn.functional.linear, x, w16), CALLS)
        print(f"{rows:4d} | {t4:.3f} ({int4_bytes / t4 / 1e6:.1f}) | {t8:.3f} ({N * K / t8 / 1e6:.1f}) | "
              f"{t16:.3f} ({2 * N * K / t16 / 1e6:.1f})")


if __name__ == "__main__":
    main()
