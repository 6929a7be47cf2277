"""What the check at every load costs: reading a whole weight store for the memory tiers with
each tensor's CRC-32 checked, against the same reads with its sha256 checked (the check before
2026-11-27), rounds interleaved, in one process.

    python runs/bench/store_checksum/checksum_ab.py --model smollm2-135m --dtype float32 --rounds 3 \
        --out runs/bench/store_checksum/checksum_ab.jsonl

The store is the one the engine loads (converted first if missing). Its CRC-32s are computed
once before timing where the store predates them. Each read bypasses the page cache, as the
engine's do, so both modes read the same bytes from disk; only the check differs. Then each
check alone over the bytes already in memory. Appends one JSON line per round and mode, with
the host and the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import time
import zlib
from pathlib import Path

from flexgen_helm.memory.machine import machine_label
from flexgen_helm.weights.convert import convert
from flexgen_helm.weights.registry import resolve, store_dir_for
from flexgen_helm.weights.store import TensorStore


def load_all(store: TensorStore) -> float:
    start = time.perf_counter()
    for name in store.tensors:
        store.read(name, verify=True)
    return time.perf_counter() - start


def check_only(store: TensorStore, check) -> float:
    """Seconds for `check` over every tensor's bytes, already in memory (no reads)."""
    data = [(store.root / t.file).read_bytes() for t in store.tensors.values()]
    start = time.perf_counter()
    for b in data:
        check(b)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    resolved = resolve(args.model)
    root = convert(resolved.source, store_dir_for(resolved, args.dtype), args.dtype, progress=False)
    by_crc = TensorStore(root)
    by_crc.tensors = {name: t if t.crc32 is not None else
                      dataclasses.replace(t, crc32=zlib.crc32((root / t.file).read_bytes()))
                      for name, t in by_crc.tensors.items()}
    by_sha = TensorStore(root)
    by_sha.tensors = {name: dataclasses.replace(t, crc32=None) for name, t in by_sha.tensors.items()}
    load_all(by_crc)  # warm-up, not recorded
    host, total = machine_label(), by_crc.total_bytes()
    for r in range(args.rounds):
        for mode, store in (("sha256", by_sha), ("crc32", by_crc)):
            seconds = load_all(store)
            row = {"round": r, "check": mode, "model": args.model, "dtype": args.dtype, "bytes": total,
                   "seconds": round(seconds, 3), "gb_per_s": round(total / seconds / 1e9, 3), "host": host,
                   "loadavg_1m": os.getloadavg()[0], "utc": datetime.datetime.now(datetime.UTC).isoformat()}
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    for mode, check in (("sha256 only", lambda b: hashlib.sha256(b).digest()), ("crc32 only", zlib.crc32)):
        seconds = check_only(by_crc, check)
        row = {"check": mode, "model": args.model, "dtype": args.dtype, "bytes": total, "seconds": round(seconds, 3),
               "gb_per_s": round(total / seconds / 1e9, 3), "host": host, "loadavg_1m": os.getloadavg()[0],
               "utc": datetime.datetime.now(datetime.UTC).isoformat()}
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
