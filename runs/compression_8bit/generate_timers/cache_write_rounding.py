"""What a compressed KV cache held dense costs a prefill write: one layer's write of a
LAMBADA-sized block (10 prompts of 60-89 tokens, left-padded, 3 kv heads, head dim 64, bf16)
into a slot that rounds it (Policy.keep_dense_cache): KIVI 4-bit (groups of 64 positions) or
8-bit per token. Median of 50 writes, ms; then torch.profiler's busiest ops.

    python runs/compression_8bit/generate_timers/cache_write_rounding.py {kivi,per-token}
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch.profiler import profile

from flexgen_helm.executor.kv_cache import KVCacheSlot
from flexgen_helm.memory.devices import pick_devices
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy.policy import Compression

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import median_seconds

GRIDS = {"kivi": Compression(4, 64, cache_grouping="kivi"), "per-token": Compression(8, 64, cache_grouping="per-token")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grid", choices=GRIDS)
    args = p.parse_args()
    keep_freed_host_memory()
    devices = pick_devices("cpu", "bfloat16")
    rng = random.Random(0)
    lengths = [rng.randrange(60, 90) for _ in range(10)]
    s, units = max(lengths), 3 * len(lengths)
    starts = torch.tensor([s - n for n in lengths for _ in range(3)])
    k, v = (torch.randn(s, units, 64).to(devices.dtype) for _ in range(2))
    kivi = args.grid == "kivi"

    def write() -> None:
        slot = KVCacheSlot({"gpu": units, "cpu": 0, "disk": 0}, s + 40, 64, devices, TierUsage(), None, False,
                           rounding=GRIDS[args.grid], starts=starts if kivi else None)
        slot.write(k, v, 0)

    print(f"# {machine_label()}: {args.grid} write {median_seconds(write, 50) * 1e3:.3f} ms (median of 50)")
    with profile() as prof:
        for _ in range(50):
            write()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=30))


if __name__ == "__main__":
    main()
