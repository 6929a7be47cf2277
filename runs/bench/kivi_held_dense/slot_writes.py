"""What a KIVI-grouped KV cache's writes cost one (layer, GPU batch), compressed
(executor/kivi_cache.KiviCacheSlot: groups quantized and packed as they complete) and held dense
(executor/kv_cache.KVCacheSlot with a KIVI rounding: groups rounded in place as they complete),
at the README main job's pattern_match shapes: 10 sequences x 3 key-value heads, head_dim 64,
groups of 64, a 230-token prefill, then 64 decode writes of one position.

    python runs/bench/kivi_held_dense/slot_writes.py [--threads 1] [--rounds 5] [--out FILE]

Rounds alternate the two slots in one process, after a warm-up; one JSON line per run (medians,
milliseconds) is appended to --out (default results.jsonl beside this file), with the host and
the load average. The compressed slot's decode steps also dequantize its groups when read
(not timed here); the dense slot is read in place.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from flexgen_helm.executor.kivi_cache import KiviCacheSlot
from flexgen_helm.executor.kv_cache import KVCacheSlot
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy import Compression

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from record import append_record, bench_args  # noqa: E402

UNITS, HEAD_DIM, PROMPT, STEPS = 30, 64, 230, 64
KIVI = Compression(4, 64, cache_grouping="kivi")


def _timed(make, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    slot = make()
    t0 = time.perf_counter()
    slot.write(k[:PROMPT], v[:PROMPT], 0)
    t1 = time.perf_counter()
    for p in range(PROMPT, PROMPT + STEPS):
        slot.write(k[p:p + 1], v[p:p + 1], p)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    args = bench_args(__doc__, HERE, rounds=5)
    torch.manual_seed(0)
    devices = Devices(torch.device("cpu"), torch.float32)
    units = {"gpu": UNITS, "cpu": 0, "disk": 0}
    starts = torch.randint(0, 20, (UNITS,))  # left paddings: units complete their groups at different steps
    # as prefill attention hands them over: (units, positions, d) transposed
    k, v = (torch.randn(UNITS, PROMPT + STEPS, HEAD_DIM).transpose(0, 1) for _ in range(2))
    slots = {
        "compressed": lambda: KiviCacheSlot(units, PROMPT + STEPS, HEAD_DIM, devices, TierUsage(), None, False,
                                            compression=KIVI, window=0, starts=starts),
        "held_dense": lambda: KVCacheSlot(units, PROMPT + STEPS, HEAD_DIM, devices, TierUsage(), None, False,
                                          rounding=KIVI, starts=starts),
    }
    for make in slots.values():
        _timed(make, k, v)
    load = os.getloadavg()[0]
    times = {name: [] for name in slots}
    for _ in range(args.rounds):
        for name, make in slots.items():
            times[name].append(_timed(make, k, v))
    record = {name: {"prefill_write_ms": round(1e3 * statistics.median(t[0] for t in runs), 2),
                     "decode_writes_ms": round(1e3 * statistics.median(t[1] for t in runs), 2)}
              for name, runs in times.items()}
    append_record(args.out, record, load, f"python runs/bench/kivi_held_dense/slot_writes.py --threads {args.threads} "
                  f"--rounds {args.rounds}", threads=args.threads, rounds=args.rounds)


if __name__ == "__main__":
    main()
