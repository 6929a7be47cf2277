"""Where a decode step's time goes with a 4-bit KV cache: the engine's own pieces of one
(layer, GPU batch), timed one by one in CPU time (thread_time: what the work costs, not how
long a loaded machine made it wait), min over repeats.

OPT-1.3B shapes (32 heads of 64, hidden 2048, MLP 8192), a GPU batch of 4 sequences (128
cache units), 512 positions cached, bfloat16, one thread; the cache in compute memory (the
"gpu" tier). Pieces: the layer's four matmuls on 4 rows; attention over the cache; loading
the cache (reading it and dequantizing it into the buffers attention reads: KVCacheSlot /
KiviCacheSlot read + unpack, and the path before reused buffers: dequantize, then a cat with
the new token); storing the new token (quantizing it; under KIVI, a 64th of a group's
quantization on average). A decode step runs each piece once per layer per GPU batch.

    PYTHONPATH=. python runs/bench/compression/kv4_decode/parts.py --json runs/bench/compression/kv4_decode/parts.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from flexgen_helm.compression.quantize import dequantize
from flexgen_helm.executor.attention import attend, decode_cache_dtype
from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.executor.kivi_cache import KiviCacheSlot
from flexgen_helm.executor.kv_cache import KVCacheSlot
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy.policy import Compression

HEADS, D, HIDDEN, MLP, BATCH, CACHED = 32, 64, 2048, 8192, 4, 512
CPU = torch.device("cpu")


def cpu_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return 1000 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    dt, units = torch.bfloat16, BATCH * HEADS
    g = torch.Generator().manual_seed(0)
    devices = Devices(CPU, dt)
    k, v = (torch.randn(CACHED + 1, units, D, generator=g).to(dt) for _ in range(2))
    weights = [torch.randn(o, i, generator=g).to(dt) for o, i in ((3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN),
                                                                   (MLP, HIDDEN), (HIDDEN, MLP))]
    inputs = [torch.randn(BATCH, w.shape[1], generator=g).to(dt) for w in weights]
    q = torch.randn(units, 1, 1, D, generator=g).to(dt)
    valid = torch.ones(units, CACHED + 1, dtype=torch.bool)
    out = {"matmuls (4 rows)": cpu_ms(lambda: [F.linear(x, w) for x, w in zip(inputs, weights)], args.repeats)}
    # as a decode step hands them to attention on the CPU: float32 (decode_cache_dtype)
    keys, values = (x.transpose(0, 1).to(decode_cache_dtype(CPU, dt)) for x in (k, v))
    out["attention over the cache"] = cpu_ms(lambda: attend(q, keys, values, valid, causal=False), args.repeats)
    for name, cfg in (("per token", Compression(4, 64, cache_grouping="per-token")),
                      ("KIVI", Compression(4, 64, cache_grouping="kivi"))):
        kw = dict(starts=torch.zeros(units, dtype=torch.long)) if cfg.kivi else {}
        cls = KiviCacheSlot if cfg.kivi else KVCacheSlot
        slot = cls({"gpu": units, "cpu": 0, "disk": 0}, CACHED + 64, D, devices, TierUsage(), None, pin=False,
                   compression=cfg, window=0, **kw)
        slot.write(k[:CACHED], v[:CACHED], 0)
        buffers = CacheBuffers()
        out[f"load, {name}: read + dequantize into reused buffers"] = cpu_ms(
            lambda slot=slot, buffers=buffers: slot.unpack("gpu", slot.read("gpu", CACHED), CPU,
                                                           decode_cache_dtype(CPU, dt), buffers), args.repeats)
        if not cfg.kivi:  # the path before: a new dense cache per load, then one more with the new token
            out[f"load, {name}: dequantize + cat (before reused buffers)"] = cpu_ms(
                lambda slot=slot: [torch.cat([dense.transpose(0, 1), new.transpose(0, 1)], dim=1)
                         for dense, new in zip((dequantize(x) for x in slot.read("gpu", CACHED)),
                                               (k[CACHED:], v[CACHED:]))], args.repeats)
        # a store at every position of a group in turn: KIVI quantizes a group at one of them
        stores = [cpu_ms(lambda p=p, slot=slot: slot.write(k[p:p + 1], v[p:p + 1], p), 1)
                  for p in range(CACHED, CACHED + 64)]
        out[f"store the new token, {name} (mean over 64 positions)"] = sum(stores) / len(stores)
        slot.close()
    result = {"what": __doc__.split("\n\n")[0], "ms_cpu_per_layer_per_gpu_batch": out, "threads": 1,
              "dtype": "bfloat16", "load_average": os.getloadavg(),
              "command": "PYTHONPATH=. python runs/bench/compression/kv4_decode/parts.py"
                         + (f" --json {args.json}" if args.json else "")}
    for name, ms in out.items():
        print(f"{ms:9.2f} ms  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
