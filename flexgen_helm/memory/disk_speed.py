"""How fast this machine's disk reads, each way a program can read it, measured on a fresh
file with its pages evicted first (so no way is served from the page cache):

    direct_1          O_DIRECT, one read at a time
    direct_in_flight  O_DIRECT with READS_IN_FLIGHT reads at once
    buffered          plain read() through the page cache (readahead), cold
    mmap              a memory map of the file copied out (what accelerate's offload does), cold

The device's bandwidth is the best of them; the engine's disk tier reads the faster of the
two O_DIRECT ways (`fastest_direct`: neither wins on every disk), and both are recorded in
the hardware profile and in every compare table."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np

from flexgen_helm.memory.direct_io import READS_IN_FLIGHT, read_bytes, write_bytes

MODES = ("direct_1", "direct_in_flight", "buffered", "mmap")


def fastest_direct(speeds: dict[str, float]) -> tuple[int, float]:
    """(reads in flight, bytes/s) of the faster O_DIRECT way among measured `speeds`
    (READS_IN_FLIGHT and 0.0 when neither was measured)."""
    one, many = speeds.get("direct_1", 0.0), speeds.get("direct_in_flight", 0.0)
    return (1, one) if one > many else (READS_IN_FLIGHT, many)


def write_test_file(path: Path, nbytes: int, chunk: int) -> None:
    """`nbytes` of random data, written through to the disk and evicted from the page cache."""
    block = os.urandom(chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off in range(0, nbytes, chunk):
            write_bytes(fd, off, block[:min(chunk, nbytes - off)])
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_all(path: Path, nbytes: int, chunk: int, mode: str) -> None:
    if mode in ("direct_1", "direct_in_flight"):
        in_flight = 1 if mode == "direct_1" else READS_IN_FLIGHT
        for off in range(0, nbytes, chunk):
            read_bytes(path, off, min(chunk, nbytes - off), bypass_page_cache=True, in_flight=in_flight)
        return
    dst = np.empty(chunk, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        if mode == "buffered":
            for off in range(0, nbytes, chunk):
                os.preadv(fd, [dst[:min(chunk, nbytes - off)]], off)
        else:
            with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as m:
                src = np.frombuffer(m, dtype=np.uint8)
                for off in range(0, nbytes, chunk):
                    n = min(chunk, nbytes - off)
                    dst[:n] = src[off:off + n]
                del src  # the map cannot close while a view of it lives
    finally:
        os.close(fd)


def measure_read_modes(directory: str | os.PathLike, nbytes: int = 512 << 20, chunk: int = 16 << 20,
                       repeats: int = 1, modes: tuple[str, ...] = MODES) -> dict:
    """Bytes/s of reading a fresh `nbytes` file in `chunk` pieces, each mode (the best of
    `repeats`, page cache evicted before each), plus the device's bandwidth (the best mode)
    and the engine's (the faster O_DIRECT way, and its reads in flight)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"flexgen-helm-disk-speed-{os.getpid()}.bin"
    speeds = {m: 0.0 for m in modes}
    try:
        write_test_file(path, nbytes, chunk)
        for _ in range(repeats):
            for mode in modes:
                evict(path)
                t0 = time.perf_counter()
                _read_all(path, nbytes, chunk, mode)
                speeds[mode] = max(speeds[mode], nbytes / (time.perf_counter() - t0))
    finally:
        path.unlink(missing_ok=True)
    best = max(speeds, key=speeds.get)
    engine_in_flight, engine_speed = fastest_direct(speeds)
    return {"read_bytes_per_s": speeds, "device_read_bytes_per_s": speeds[best], "best_mode": best,
            "reads_in_flight": READS_IN_FLIGHT, "engine_reads_in_flight": engine_in_flight,
            "engine_read_bytes_per_s": engine_speed, "file_bytes": nbytes, "chunk_bytes": chunk,
            "directory": str(directory)}
