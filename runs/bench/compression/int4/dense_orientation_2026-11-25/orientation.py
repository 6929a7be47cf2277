"""Above the int4 kernel's crossover a packed weight is dequantized once and multiplied in a plain
matmul (compression/int4.py, CompressedWeight.dense). Its dense copy can be made by column (the
transpose of a contiguous (in, out) matrix: the faster decode) or by row (contiguous (out, in):
one transposing copy more). This times both whole paths, dequantize then F.linear, per weight
shape and activation row count, alternating, and prints the ratio by row / by column: above 1,
by column is the faster path at that row count.

    PYTHONPATH=<checkout> [ROWS="256 512 ..."] [ONLY=<part of a weight name>] python orientation.py [rounds]
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from flexgen_helm.compression.int4 import dequantize_packed, pack_int4
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy.policy import Compression

SHAPES = {  # (out, in) of the weights the README main job and the OPT benches multiply
    "SmolLM2 gate/up": (1536, 576), "SmolLM2 down": (576, 1536), "SmolLM2 q/o": (576, 576),
    "SmolLM2 head": (49152, 576), "OPT-1.3B fc1": (8192, 2048), "OPT-1.3B fc2": (2048, 8192),
    "OPT-1.3B q/k/v/o": (2048, 2048),
}
ROWS = tuple(int(r) for r in os.environ.get("ROWS", "256 512 768 1024 1536 2048").split())


def path(p, x, by_column: bool) -> torch.Tensor:
    return F.linear(x, dequantize_packed(p, torch.bfloat16, by_column=by_column))


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(rounds: int) -> None:
    keep_freed_host_memory()  # as every engine runs (memory/host_allocator.py)
    print(f"host {machine_label()}, torch {torch.__version__}, "
          f"load {open('/proc/loadavg').read().split()[0]}")
    g = torch.Generator().manual_seed(0)
    print("| weight | (out, in) | rows | by column ms | by row ms | by row / by column |")
    print("|---|---|---:|---:|---:|---:|")
    only = os.environ.get("ONLY")
    for name, (n, k) in SHAPES.items():
        if only and only not in name:
            continue
        p = pack_int4(quantize(torch.randn(n, k, generator=g), Compression(bits=4, group_size=64), 1),
                      torch.device("cpu"))
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            assert torch.equal(path(p, x, True), path(p, x, False))  # the same weights either way
            col, row = [], []
            for _ in range(rounds):
                col.append(best_of(lambda p=p, x=x: path(p, x, True), 3))
                row.append(best_of(lambda p=p, x=x: path(p, x, False), 3))
            c, r = statistics.median(col) * 1e3, statistics.median(row) * 1e3
            print(f"| {name} | ({n}, {k}) | {rows} | {c:.2f} | {r:.2f} | {r / c:.2f} |", flush=True)
    print(f"load {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
