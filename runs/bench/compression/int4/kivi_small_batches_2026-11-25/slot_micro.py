"""One KIVI cache slot of a small GPU batch (3 sequences x 3 key-value heads, 75-token prompts
left-padded by 0/2/4, head_dim 64, groups of 64, bf16 storage): the prefill's write and a decode
step's unpack into float32 buffers, as the CPU's decode attention reads them.

    PYTHONPATH=<checkout> python slot_micro.py
"""

import time

import torch

import flexgen_helm
from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.executor.kivi_cache import KiviCacheSlot
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy.policy import Compression

CFG = Compression(4, 64, cache_grouping="kivi")
HEADS, HEAD_DIM, PROMPT = 3, 64, 75
STARTS = torch.tensor([0, 2, 4] * HEADS)
UNITS = len(STARTS)


def slot() -> KiviCacheSlot:
    return KiviCacheSlot({"gpu": UNITS, "cpu": 0, "disk": 0}, PROMPT + 8, HEAD_DIM,
                         Devices(torch.device("cpu"), torch.bfloat16), TierUsage(), None, pin=False,
                         compression=CFG, window=0, starts=STARTS)


def main() -> None:
    k = torch.randn(PROMPT, UNITS, HEAD_DIM, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    v = torch.randn_like(k)
    for _ in range(10):
        slot().write(k, v, 0)
    slots = [slot() for _ in range(100)]
    t0 = time.perf_counter()
    for s in slots:
        s.write(k, v, 0)
    write_ms = (time.perf_counter() - t0) / len(slots) * 1e3
    buffers, cpu = CacheBuffers(1), torch.device("cpu")
    t0 = time.perf_counter()
    for _ in range(200):
        slots[0].unpack("gpu", slots[0].read("gpu", PROMPT + 3), cpu, torch.float32, buffers)
    unpack_ms = (time.perf_counter() - t0) / 200 * 1e3
    print(f"{flexgen_helm.__file__}: prefill write {write_ms:.3f} ms, decode unpack {unpack_ms:.3f} ms")


if __name__ == "__main__":
    main()
