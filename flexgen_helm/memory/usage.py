"""Bytes held on each tier, now and at peak, as the engine allocates them."""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from flexgen_helm.policy.policy import TIERS


class TierUsage:
    """Bookkeeping of the tensors the engine places (weights, KV cache, activations and
    transient buffers). On CUDA the GPU peak is also read from torch's allocator."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = defaultdict(int)
        self.peak = defaultdict(int)

    def add(self, tier: str, nbytes: int) -> None:
        with self._lock:
            self.current[tier] += nbytes
            self.peak[tier] = max(self.peak[tier], self.current[tier])

    def remove(self, tier: str, nbytes: int) -> None:
        with self._lock:
            self.current[tier] -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = defaultdict(int, self.current)

    def snapshot(self) -> dict:
        return {t: {"current_bytes": self.current[t], "peak_bytes": self.peak[t]} for t in TIERS}


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM), pinned memory included."""
    peak = _proc_status_bytes("VmHWM:")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_anonymous_bytes() -> int:
    """Anonymous resident memory of this process (RssAnon: the heap, mmapped blocks, stacks;
    not the mapped files of its libraries); 0 where /proc is missing."""
    return _proc_status_bytes("RssAnon:") or 0


def current_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS); 0 where /proc is missing."""
    return _proc_status_bytes("VmRSS:") or 0


def process_disk_read_bytes() -> int:
    """Bytes this process has caused to be read from storage, not served by the page cache
    (/proc/self/io read_bytes); 0 where /proc is missing."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
