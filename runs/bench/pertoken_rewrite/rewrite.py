"""What a decode step's rewrite of one (layer, GPU batch) costs a per-token KV cache held dense
(executor/kv_cache.KVCacheSlot with a per-token rounding: the 8-bit deployment's cache) once
some sequences have finished: the packed units' rows rounded and copied to the front of their
row (KVCacheSlot._rewrite_packed), against the general write, which scatters them among all
the units and picks them back out (the path before; forced here by turning the check off).

    python runs/bench/pertoken_rewrite/rewrite.py [--threads 1] [--rounds 7] [--out FILE]

Shapes: head_dim 64, 8 bits in groups of 64; 30 units (the main job's 10 pattern_match requests:
10 sequences x 3 key-value heads) and 300 (pattern_match's block of 100), a third of them still
computing, a 40-position prompt, then 64 decode steps (append_in_place, then the rewrite timed).
Rounds alternate the two paths in one process, after a warm-up; both must leave the computed
units' rows bit for bit the same, and each run must take the path it names, or the run stops.
One JSON line per run (medians, ms per rewrite) is appended to --out (default results.jsonl
beside this file), with the host and load.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from flexgen_helm.executor.kv_cache import KVCacheSlot
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy import Compression

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from record import append_record, bench_args  # noqa: E402

HEAD_DIM, PROMPT, STEPS = 64, 40, 64
ROUNDING = Compression(8, 64, cache_grouping="per-token")


def _run(units: int, packed_path: bool) -> tuple[float, KVCacheSlot]:
    """ms per rewrite, and the slot."""
    torch.manual_seed(1)
    live = torch.arange(0, units, 3)
    slot = KVCacheSlot({"gpu": units, "cpu": 0, "disk": 0}, PROMPT + STEPS, HEAD_DIM,
                       Devices(torch.device("cpu"), torch.float32), TierUsage(), None, False, rounding=ROUNDING)
    if not packed_path:
        slot._rewrites_packed = lambda positions, tiers: False  # the general write, as before
    taken = []  # the steps that took the packed rewrite: all of them, or none, as the run names
    rewrite = slot._rewrite_packed
    slot._rewrite_packed = lambda *args: (taken.append(args[2]), rewrite(*args))
    prompt = torch.randn(PROMPT, units, HEAD_DIM)
    slot.write(prompt, prompt.clone(), 0)
    spent = 0.0
    for position in range(PROMPT, PROMPT + STEPS):
        k, v = torch.randn(len(live), 1, HEAD_DIM), torch.randn(len(live), 1, HEAD_DIM)
        slot.append_in_place("gpu", k, v, position, live)
        t0 = time.perf_counter()
        slot.write(k.transpose(0, 1), v.transpose(0, 1), position, live, ("gpu",))
        spent += time.perf_counter() - t0
    if len(taken) != (STEPS if packed_path else 0):
        sys.exit(f"{units} units: the {'packed' if packed_path else 'general'} run took the packed rewrite at "
                 f"{len(taken)} of {STEPS} steps: it would not time what it names")
    return 1e3 * spent / STEPS, slot


def main() -> None:
    args = bench_args(__doc__, HERE, rounds=7)
    load = os.getloadavg()[0]
    record = {}
    for units in (30, 300):
        n = len(range(0, units, 3))
        general, packed = _run(units, False)[1], _run(units, True)[1]  # warm-up, and the same rows
        for name, kept in (("k", "k"), ("v", "v")):
            a, b = getattr(general, kept)["gpu"][:, :n], getattr(packed, kept)["gpu"][:, :n]
            if not torch.equal(a, b):
                sys.exit(f"{units} units: the two paths wrote different {name} rows")
        times = {"general_write_ms": [], "packed_rewrite_ms": []}
        for _ in range(args.rounds):
            times["general_write_ms"].append(_run(units, False)[0])
            times["packed_rewrite_ms"].append(_run(units, True)[0])
        record[f"units_{units}"] = {name: round(statistics.median(t), 4) for name, t in times.items()}
    append_record(args.out, record, load, f"python runs/bench/pertoken_rewrite/rewrite.py --threads {args.threads} "
                  f"--rounds {args.rounds}", threads=args.threads, rounds=args.rounds)


if __name__ == "__main__":
    main()
