"""What a compressed KV cache held dense costs a prefill write: one layer's write of a
LAMBADA-sized block (10 prompts of 60-89 tokens, left-padded, 3 kv heads, head dim 64, bf16)
into a slot that rounds it (Policy.keep_dense_cache): KIVI 4-bit (groups of 64 positions) or
8-bit per token. Median of 50 writes, ms; then torch.profiler's busiest ops. --decode: the
decode step's write of one position that completes some units' KIVI groups instead (into a
slot the prefill wrote).

    python runs/compression_8bit/generate_timers/cache_write_rounding.py {kivi,per-token} [--decode]
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
    p.add_argument("--decode", action="store_true", help="a one-position write completing KIVI groups (kivi only)")
    args = p.parse_args()
    if args.decode and args.grid != "kivi":
        p.error("--decode times a write that completes KIVI groups: use it with kivi")
    keep_freed_host_memory()
    devices = pick_devices("cpu", "bfloat16")
    rng = random.Random(0)
    lengths = [rng.randrange(60, 90) for _ in range(10)]
    s, units = max(lengths), 3 * len(lengths)
    starts = torch.tensor([s - n for n in lengths for _ in range(3)])
    k, v = (torch.randn(s, units, 64).to(devices.dtype) for _ in range(2))
    kivi = args.grid == "kivi"

    def new_slot() -> KVCacheSlot:
        return KVCacheSlot({"gpu": units, "cpu": 0, "disk": 0}, s + 80, 64, devices, TierUsage(), None, False,
                           rounding=GRIDS[args.grid], starts=starts if kivi else None)

    def write() -> None:
        new_slot().write(k, v, 0)

    what = "write"
    if args.decode:
        prefilled = new_slot()
        prefilled.write(k, v, 0)
        position = next(p for p in range(s, s + 80) if prefilled._completes_group(p))
        k1, v1 = (torch.randn(1, units, 64).to(devices.dtype) for _ in range(2))

        def write() -> None:  # the same position again: each time the groups it completes are rounded
            prefilled.write(k1, v1, position)

        what = f"decode write of position {position}, completing groups"
    print(f"# {machine_label()}: {args.grid} {what} {median_seconds(write, 50) * 1e3:.3f} ms (median of 50)")
    with profile() as prof:
        for _ in range(50):
            write()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=30))


if __name__ == "__main__":
    main()
