"""The profile's overlap-loss probe (planner/hardware_profile.measure_disk_overlap_loss) with a
4-bit decode step's products (torch's int4 kernel at 4 rows, 192 OLMoE-expert-sized weights: 201 MB,
beyond the caches) in place of its dense bf16 linears, three times; then the profile's own probe.

    python runs/bench/disk_cache_in_place/overlap_probe_int4.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from flexgen_helm.memory.disk_buffer import DiskBuffer
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner import hardware_profile as hp

N, K, GROUP = 1024, 2048, 64  # an OLMoE expert's gate (or up) projection
WEIGHTS, ROWS, TRIALS = 192, 4, 3
FILE_BYTES = 128 << 20


def main() -> None:
    torch.manual_seed(0)
    weights = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 2),
                torch.randn(K // GROUP, N, 2).bfloat16().contiguous()) for _ in range(WEIGHTS)]
    x = torch.randn(ROWS, K).bfloat16()

    def products(n: int) -> None:
        for i in range(n):
            packed, scales_zeros = weights[i % WEIGHTS]
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)

    folder = Path(tempfile.mkdtemp(dir=os.environ.get("FLEXGEN_HELM_OFFLOAD", "/tmp"), prefix="probe-"))
    buf = DiskBuffer(folder / "overlap.bin", FILE_BYTES)
    try:
        buf.write(0, torch.randint(0, 255, (FILE_BYTES,), dtype=torch.uint8))
        os.sync()

        def reads(n: int) -> None:
            for i in range(n):
                buf.read((i * hp.OVERLAP_READ) % (FILE_BYTES - hp.OVERLAP_READ), (hp.OVERLAP_READ,), torch.uint8)

        print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}")
        for _ in range(TRIALS):
            print(f"int4 kernel, {ROWS} rows: loss {hp.overlap_loss(products, reads, 0.5):.2f}")
        print("the profile's own probe:", hp.measure_disk_overlap_loss(folder, torch.bfloat16))
    finally:
        buf.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
