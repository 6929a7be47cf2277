"""Whether an OLMoE expert's gate and up weights fused into one 2048 x 2048 int4 weight would pay at a
decode step's few rows an expert: the CPU int4 kernel (CompressedWeight.linear on packed codes, 4-bit,
groups of 64) over 24 experts' distinct weights (so that no call finds its weight in the caches),
two 1024 x 2048 calls against one 2048 x 2048 call; ms per expert, the median of 6 rounds.

    python runs/bench/moe_decode_step/gate_up_fused.py
"""

import time

import torch

from flexgen_helm.compression.int4 import CompressedWeight, pack_int4
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy.policy import Compression

EXPERTS = 24


def weight(n: int, k: int) -> CompressedWeight:
    p = pack_int4(quantize(torch.randn(n, k).to(torch.bfloat16), Compression(4, 64, 1), 1), torch.device("cpu"))
    return CompressedWeight([(0, p)], p.shape, torch.bfloat16, max_kernel_rows=32)


def ms_per_expert(calls) -> float:
    t0 = time.perf_counter()
    calls()
    return (time.perf_counter() - t0) / EXPERTS * 1e3


def main() -> None:
    torch.manual_seed(0)
    print(f"# {machine_label()}")
    gates, ups = [weight(1024, 2048) for _ in range(EXPERTS)], [weight(1024, 2048) for _ in range(EXPERTS)]
    fused = [weight(2048, 2048) for _ in range(EXPERTS)]
    for rows in (2, 3, 16):
        x = torch.randn(rows, 2048).to(torch.bfloat16)
        apart = sorted(ms_per_expert(lambda x=x: [w.linear(x) for pair in zip(gates, ups) for w in pair])
                       for _ in range(6))
        together = sorted(ms_per_expert(lambda x=x: [w.linear(x) for w in fused]) for _ in range(6))
        print(f"{rows} rows: gate and up apart {apart[3]:.3f} ms, fused {together[3]:.3f} ms an expert "
              f"(fused/apart {together[3] / apart[3]:.2f})", flush=True)


if __name__ == "__main__":
    main()
