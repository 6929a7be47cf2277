"""Whether a decode step's attention rate on this host follows its allocation or the time: three
sets of OLMoE-1B-7B-sized caches (16 layers of 128 units x 529 positions x 128, bf16, K and V),
allocated once, each read by attention.attend as a decode step reads them, in turn, once a second,
--seconds times. Prints GB/s of cache per set and second.

    python runs/bench/moe_decode_step/memory_modes.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from flexgen_helm.executor.attention import attend
from flexgen_helm.memory.machine import machine_label

LAYERS, UNITS, POSITIONS, WIDTH = 16, 128, 529, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=20)
    args = p.parse_args()
    dtype = torch.bfloat16
    sets = {name: [[torch.randn(POSITIONS, UNITS, WIDTH).to(dtype) for _ in range(2)] for _ in range(LAYERS)]
            for name in "ABC"}
    q = torch.randn(UNITS, 1, 1, WIDTH).to(dtype)
    valid = torch.ones(UNITS, POSITIONS, dtype=torch.bool)
    nbytes = LAYERS * 2 * POSITIONS * UNITS * WIDTH * 2

    def rate(caches) -> float:
        def step():
            for k, v in caches:
                attend(q, k.transpose(0, 1), v.transpose(0, 1), valid, causal=False)
        step()
        start = time.perf_counter()
        step()
        step()
        return 2 * nbytes / (time.perf_counter() - start) / 1e9

    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}: GB/s of cache a decode step's attention reads")
    for second in range(args.seconds):
        print(f"{second:3d} " + "  ".join(f"{name} {rate(c):5.1f}" for name, c in sets.items()), flush=True)
        time.sleep(1)


if __name__ == "__main__":
    main()
