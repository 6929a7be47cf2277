"""The disk side of the comparison: the bandwidth our roofline uses (O_DIRECT reads of a
large file in the offload dir, the same call the engine's disk tier makes) and page-cache
eviction for systems that read through it (accelerate memory-maps its offloaded weights)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from flexgen_helm.memory.direct_io import read_bytes, write_bytes

CHUNK = 64 * 2**20  # about one OPT-6.7B weight matrix (4096 x 4096 bf16 is 32 MiB, fc1 is 128 MiB)


def measure_read_bandwidth(directory: str | os.PathLike, nbytes: int = 2 * 2**30, repeats: int = 2) -> dict:
    """Bytes/s of sequential O_DIRECT reads of a fresh `nbytes` file (median of `repeats`);
    the file is written with its pages evicted, so no read is served from the page cache."""
    path = Path(directory) / "flexgen-helm-bandwidth.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, nbytes, CHUNK):
            write_bytes(fd, off, block)
    finally:
        os.close(fd)
    speeds = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for off in range(0, nbytes, CHUNK):
                read_bytes(path, off, CHUNK)
            speeds.append(nbytes / (time.perf_counter() - t0))
    finally:
        path.unlink()
    speeds.sort()
    return {"read_bytes_per_s": speeds[len(speeds) // 2], "all_bytes_per_s": speeds, "file_bytes": nbytes,
            "chunk_bytes": CHUNK, "directory": str(directory)}


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
