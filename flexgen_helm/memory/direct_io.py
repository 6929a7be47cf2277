"""File reads and writes that do not leave their data in the OS page cache, so that
disk-tier timings measure the disk (the paper's honesty requirement).

A large read can be split into up to READS_IN_FLIGHT aligned O_DIRECT reads issued at once
by reader threads: a virtual disk or an SSD may only reach its bandwidth with several
requests queued (the 2-core EPYC host's virtio disk, 1 GiB read: 0.6-0.78 GB/s one 16 MiB
read at a time, 0.8-1.1 GB/s with 4 in flight), while another disk reads faster one at a
time (a later profile of the same kind of host: 1.61 GB/s one at a time, 1.49 GB/s with 4 in
flight). So the way is not fixed: `flexgen-helm profile` measures both
(memory/disk_speed.py) and the commands that load an engine set the faster one with
`set_reads_in_flight` (planner/hardware_profile.use_profile); without a
profile, READS_IN_FLIGHT.

Reads land in memory from torch's allocator (a page-aligned view of a uint8 tensor): with
the engine's allocator setting (host_allocator.py) freed buffers are reused already
faulted in, where a fresh anonymous mapping per read paid a page fault per 4 KiB inside
the read (0.3-0.46 GB/s instead of 0.72-0.78, one read in flight).
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 4096
READS_IN_FLIGHT = 4  # the most reads a large read is split into
MIN_PIECE = 1 << 20  # smaller reads go whole: splitting them only adds thread hand-offs

_in_flight = READS_IN_FLIGHT  # what read_bytes splits a large read into by default

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=READS_IN_FLIGHT, thread_name_prefix="flexgen-read")
        return _pool


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose first byte is ALIGN-aligned, as O_DIRECT requires."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


def _evict(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def set_reads_in_flight(n: int) -> None:
    """How many O_DIRECT reads read_bytes splits a large read into from now on (1: one
    read at a time), for the whole process: the way this machine's profile measured faster."""
    global _in_flight
    if not 1 <= n <= READS_IN_FLIGHT:
        raise ValueError(f"reads in flight must be 1..{READS_IN_FLIGHT}, got {n}")
    _in_flight = n


def reads_in_flight() -> int:
    return _in_flight


def bypass_mode() -> str:
    """How the disk tier avoids the page cache on this platform."""
    if hasattr(os, "O_DIRECT"):
        return "O_DIRECT, one read at a time" if _in_flight == 1 else f"O_DIRECT, {_in_flight} reads in flight"
    if hasattr(os, "posix_fadvise"):
        return "posix_fadvise(DONTNEED)"
    return "none (page cache in use)"


def read_bytes(path: Path, offset: int, length: int, bypass_page_cache: bool = True,
               in_flight: int | None = None, room: int = 0) -> memoryview:
    """Bytes [offset, offset + length) of a file, read around the page cache if asked (with up
    to `in_flight` reads at once; default: set_reads_in_flight's), then `room` bytes more of the
    same buffer, their contents undefined: space the caller fills itself (a KV cache read
    leaves a row there for the new token), so that the read needs no copy to grow."""
    if length + room == 0:
        return memoryview(b"")
    if bypass_page_cache and hasattr(os, "O_DIRECT") and length:
        try:
            return _read_direct(path, offset, length, _in_flight if in_flight is None else in_flight, room)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the file system refuses O_DIRECT
                raise
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = torch.empty(length + room, dtype=torch.uint8).numpy()
        got = os.preadv(fd, [buf[:length]], offset)
        if got != length:
            raise EOFError(f"{path}: short read ({got} of {length} bytes at offset {offset})")
        if bypass_page_cache:
            _evict(fd, offset, length)
        return memoryview(buf)
    finally:
        os.close(fd)


def _read_direct(path: Path, offset: int, length: int, in_flight: int, room: int = 0) -> memoryview:
    start = offset - offset % ALIGN
    end = offset + length
    span = -(-(end - start) // ALIGN) * ALIGN
    buf = aligned_empty(max(span, end - start + room)).numpy()
    # pieces of whole pages, at most `in_flight` of them, none smaller than MIN_PIECE
    pieces = max(1, min(in_flight, span // MIN_PIECE))
    step = -(-span // pieces // ALIGN) * ALIGN
    ranges = [(a, min(a + step, span)) for a in range(0, span, step)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        if len(ranges) == 1:
            got = [_fill(fd, buf, start, *ranges[0])]
        else:
            got = list(_readers().map(lambda r: _fill(fd, buf, start, *r), ranges))
    finally:
        os.close(fd)
    need = end - start
    for (a, b), n in zip(ranges, got):
        if a < need and n < min(b, need) - a:  # the file ended before the bytes asked for
            have = a + n - (offset - start)
            raise EOFError(f"{path}: short read ({max(have, 0)} of {length} bytes at offset {offset})")
    return memoryview(buf)[offset - start:end - start + room]


def _fill(fd: int, buf, file_start: int, a: int, b: int) -> int:
    """Read file bytes [file_start + a, file_start + b) into buf[a:b]; bytes read (fewer at EOF)."""
    view = memoryview(buf)[a:b]
    got = 0
    while got < b - a:
        n = os.preadv(fd, [view[got:]], file_start + a + got)
        if n == 0:
            break
        got += n
    return got


def write_bytes(fd: int, offset: int, data, evict: bool = True) -> None:
    """Write at an offset of an open file, then drop those pages from the cache."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
    if evict:
        os.fdatasync(fd)
        _evict(fd, offset, len(view))
