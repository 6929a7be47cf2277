"""The disk side of the comparison: the bandwidth our roofline uses (the best of several ways
of reading a large file in the offload dir, among them the engine's own reader) and
page-cache eviction for systems that read through it (accelerate memory-maps its offloaded
weights)."""

from __future__ import annotations

import os
from pathlib import Path

from flexgen_helm.memory.disk_speed import measure_read_modes

CHUNK = 64 * 2**20  # about one OPT-6.7B weight matrix (4096 x 4096 bf16 is 32 MiB, fc1 is 128 MiB)


def measure_read_bandwidth(directory: str | os.PathLike, nbytes: int = 2 * 2**30, repeats: int = 2) -> dict:
    """Each way of reading a fresh `nbytes` file (memory/disk_speed.py, best of `repeats`):
    `device_read_bytes_per_s` (the best way: what the roofline uses) and `read_bytes_per_s`
    per way, of which `direct_in_flight` is our engine's reader."""
    return measure_read_modes(directory, nbytes, CHUNK, repeats)


def evict_page_cache(paths) -> int:
    """Drop every given file (or every file under a given folder) from the OS page cache, so
    the next read comes from the disk. Returns the number of bytes advised away."""
    total = 0
    for p in paths:
        p = Path(p)
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd) if os.access(f, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += f.stat().st_size
            finally:
                os.close(fd)
    return total
