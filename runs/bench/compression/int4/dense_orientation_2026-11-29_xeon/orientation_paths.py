"""Dequantize-then-multiply, by column against by row, timed as whole paths in pairs (the
profile's paired_ratio: the median over 7 pairs of calls made back to back, after a warm-up of each), on OLMoE-1B-7B's
expert shapes and the profile's 4096 x 2048 layer, at 1024-8192 activation rows.

    python runs/bench/compression/int4/dense_orientation_2026-11-29_xeon/orientation_paths.py
"""

import functools
import os

import torch
import torch.nn.functional as F

from flexgen_helm.compression.int4 import dequantize_packed, pack_int4
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.planner.hardware_profile import paired_ratio
from flexgen_helm.policy.policy import Compression


def path(p, x, by_column: bool) -> None:
    F.linear(x, dequantize_packed(p, torch.bfloat16, by_column))


def main() -> None:
    keep_freed_host_memory()  # as the engine runs
    for shape in ((1024, 2048), (2048, 1024), (4096, 2048)):
        p = pack_int4(quantize(torch.randn(shape).to(torch.bfloat16), Compression(4, 64, 1), 1), torch.device("cpu"))
        for rows in (1024, 2048, 4096, 8192):
            x = torch.randn(rows, shape[1]).to(torch.bfloat16)
            r = paired_ratio(functools.partial(path, p, x, True), functools.partial(path, p, x, False), pairs=7)
            print(shape, rows, f"by column / by row time: {r:.3f}", flush=True)
    print("load", os.getloadavg()[0])


if __name__ == "__main__":
    main()
