"""Buffers that a decode step's cache is unpacked into, reused from step to step.

Every (layer, GPU batch) of a decode step loads its cache off the tier it lives on and
unpacks it where attention runs (dequantized under cache compression). Each load writes
into buffers taken here, so that the dequantized cache and the working copies of the
dequantization are allocated once per run instead of once per layer per step.

Where the copy engine unpacks a load (a GPU: the unpack holds the host-to-device copy), two
sets of buffers take turns (`next_set`, once per load): the schedule has at most two cache
loads alive, the one being computed with and the one the copy engine prepares for next; a
load is taken only after the load before it was consumed, so the set it overwrites belongs
to compute that was queued before it: on a GPU the copy stream waits for that compute to
finish on the device (the `ready` event of CopyEngine.submit), the host does not. Where the
compute thread unpacks (a CPU), it does so after the load before was computed with, so one
set serves. A load is one GPU batch's cache, or
(a merged decode step, schedule.py) a group of GPU batches' of one layer, each batch in its
own buffers of the set (`of_batch`). A buffer that is too small is replaced by one twice
the size asked for, so a cache that grows a position per step reallocates a handful of
times per run, not at every step."""

from __future__ import annotations

import math

import torch

from flexgen_helm.compression.quantize import Scratch

# What the cache loads of a merged decode step may hold in memory at once, at most (unless one
# GPU batch's load holds more): their reads as read and the buffers they are unpacked into
# (load_group). A load's batches' reads go out together, since a disk read waits its turn
# behind the weight lane's large ones (memory/copy_engine.py): beside a stream of 64 MiB reads
# on the 2-core EPYC's disk, 4.5 MB reads got 94 MB/s one at a time, 258 two at a time, 353
# four at a time. A load of a whole layer reads while the layer before computes all of its
# own, where a load per batch leaves the disk idle between them: OLMoE-1B-7B at a block of 32
# (two batches of 16 with 68% of their cache on disk, ~48 MB a batch a layer), decode steps of
# 1,750 against 2,179 ms (runs/bench/disk_cache_in_place/NOTES.md). So a layer is one load
# where WHOLE_LAYER_LOAD_BYTES holds it, else loads of a part of it that GROUP_LOAD_BYTES
# holds: the loads' memory is the compute pool's, which bounds the block (OPT-6.7B at 4 x 32 in
# a 1.5 GiB pool needed 1.61 GiB with parts of 256 MiB). 128 MiB keeps what the cap of 32 MiB
# read allowed a 16-bit cache unpacked to float32 on a CPU; a cache read in place (nothing
# unpacked) loads twice as much at once.
WHOLE_LAYER_LOAD_BYTES = 256 << 20
GROUP_LOAD_BYTES = 128 << 20


def load_group(as_read: float, unpacked: float, batches: int, on_lane: bool) -> tuple[int, float]:
    """GPU batches in one cache load of a merged decode step, and the memory the loads hold at
    once, from what one batch's load of a layer is as read and as unpacked (nothing where
    attention reads it where it landed, kv_cache.KVCacheSlot.reads_in_place). Alive at once:
    the sets of unpacked buffers (buffer_sets), and as read, the next load (on a CPU also the
    one in use until the compute thread unpacks it, after the next one's reads went out)."""
    per_batch = buffer_sets(on_lane) * unpacked + (1 if on_lane else 2) * as_read
    if per_batch <= 0 or batches * per_batch <= WHOLE_LAYER_LOAD_BYTES:
        return batches, batches * per_batch
    n = max(1, min(batches, int(GROUP_LOAD_BYTES // per_batch)))
    return n, n * per_batch


def unpacks_on_lane(is_cuda: bool) -> bool:
    """Whether the copy engine's lane unpacks a cache load (a GPU: the unpack holds the
    host-to-device copy, which belongs on the lane's stream), or the compute thread does (a
    CPU: the unpack is compute, and on the lane the disk would idle while the lane converts)."""
    return is_cuda


def buffer_sets(unpack_on_lane: bool) -> int:
    """Sets of buffers that take turns (module doc)."""
    return 2 if unpack_on_lane else 1


class CacheBuffers:
    def __init__(self, sets: int):
        self._sets: list[dict] = [{} for _ in range(sets)]
        self._turn = 0
        self.allocations = 0  # buffers allocated so far (a test checks that steps stop adding any)

    def next_set(self) -> None:
        """The other set, for the next load."""
        self._turn = (self._turn + 1) % len(self._sets)

    def take(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `shape` from this set's buffer `name` (contents left from earlier use)."""
        numel = math.prod(shape)
        key = (name, dtype, torch.device(device))
        buf = self._sets[self._turn].get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(2 * numel, dtype=dtype, device=device)
            self._sets[self._turn][key] = buf
            self.allocations += 1
        return buf[:numel].view(shape)

    def scratch(self, device: torch.device) -> Scratch:
        """Working copies of a dequantization on `device`, one buffer per dtype: a
        dequantization asks for each dtype at most once, and is done before the next asks."""
        return lambda shape, dtype: self.take("scratch", shape, dtype, device)

    def of_batch(self, i: int) -> BatchBuffers:
        """The buffers of the i-th GPU batch of a group's load, in this set."""
        return BatchBuffers(self, i)


class BatchBuffers:
    """One GPU batch's own buffers within a CacheBuffers set (take and scratch as there)."""

    def __init__(self, buffers: CacheBuffers, batch: int):
        self._buffers, self._batch = buffers, batch

    def take(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._buffers.take(f"{name}@{self._batch}", shape, dtype, device)

    def scratch(self, device: torch.device) -> Scratch:
        # shared by the batches: a group's load unpacks them one after another
        return self._buffers.scratch(device)
