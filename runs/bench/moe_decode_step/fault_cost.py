"""What a minor page fault costs on this host: 256 MiB allocated and touched afresh (one fault a
4 KiB page), against touching it again, after 2 GiB were touched and freed (and waiting up to 10 s,
in case the host reclaims freed pages).

    python runs/bench/moe_decode_step/fault_cost.py

Output: fault_cost_2026-11-29.txt.
"""

from __future__ import annotations

import resource
import time

import torch


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    for wait in (0.0, 0.5, 3.0, 10.0):
        big = torch.empty(2 << 30, dtype=torch.uint8)
        big.fill_(1)
        del big
        time.sleep(wait)
        f0, t0 = faults(), time.perf_counter()
        a = torch.empty(256 << 20, dtype=torch.uint8)
        a.fill_(1)
        first, n = time.perf_counter() - t0, faults() - f0
        t1 = time.perf_counter()
        a.fill_(2)
        again = time.perf_counter() - t1
        print(f"after 2 GiB freed and {wait:4.1f} s: first touch {first * 1e3:.0f} ms ({n} faults), again "
              f"{again * 1e3:.0f} ms: {(first - again) / n * 1e6:.2f} us a fault", flush=True)


if __name__ == "__main__":
    main()
