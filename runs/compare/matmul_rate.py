"""This host's bf16 matmul rate at the shapes of an OPT-6.7B prefill, the rate the physical bounds in
NOTES.md divide by (one run: median of 5 after 2 warm-ups per shape, with host and load).

    python runs/compare/matmul_rate.py
"""

import statistics
import time

import torch

from flexgen_helm.memory.machine import machine_label

SHAPES = ((4096, 4096, 4096), (2048, 4096, 4096), (512, 4096, 16384), (512, 16384, 4096))


def main() -> None:
    print(f"host {machine_label()}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), load {open('/proc/loadavg').read().split()[0]}")
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        a = torch.randn(m, k, generator=g).to(torch.bfloat16)
        b = torch.randn(k, n, generator=g).to(torch.bfloat16)
        for _ in range(2):
            a @ b
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        print(f"{m} x {k} x {n}: {2 * m * k * n / statistics.median(times) / 1e12:.3f} TFLOP/s")
    print(f"load {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
