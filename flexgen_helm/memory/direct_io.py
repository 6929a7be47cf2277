"""File reads and writes that do not leave their data in the OS page cache, so that
disk-tier timings measure the disk (the paper's honesty requirement)."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

ALIGN = 4096


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    # Anonymous mappings are page aligned, as O_DIRECT requires of the destination.
    return mmap.mmap(-1, max(nbytes, ALIGN))


def _evict(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def bypass_mode() -> str:
    """How the disk tier avoids the page cache on this platform."""
    if hasattr(os, "O_DIRECT"):
        return "O_DIRECT"
    if hasattr(os, "posix_fadvise"):
        return "posix_fadvise(DONTNEED)"
    return "none (page cache in use)"


def read_bytes(path: Path, offset: int, length: int, bypass_page_cache: bool = True) -> memoryview:
    """Bytes [offset, offset + length) of a file, read around the page cache if asked."""
    if length == 0:
        return memoryview(b"")
    if bypass_page_cache and hasattr(os, "O_DIRECT"):
        try:
            return _read_direct(path, offset, length)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the file system refuses O_DIRECT
                raise
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(length)
        got = os.preadv(fd, [buf], offset)
        if got != length:
            raise EOFError(f"{path}: short read ({got} of {length} bytes at offset {offset})")
        if bypass_page_cache:
            _evict(fd, offset, length)
        return memoryview(buf)
    finally:
        os.close(fd)


def _read_direct(path: Path, offset: int, length: int) -> memoryview:
    start = offset - offset % ALIGN
    end = offset + length
    span = -(-(end - start) // ALIGN) * ALIGN
    buf = _aligned_buffer(span)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = 0
        while got < end - start:
            n = os.preadv(fd, [memoryview(buf)[got:]], start + got)
            if n == 0:
                break
            got += n
    finally:
        os.close(fd)
    if got < end - start:
        raise EOFError(f"{path}: short read ({got - (offset - start)} of {length} bytes at offset {offset})")
    return memoryview(buf)[offset - start:end - start]


def write_bytes(fd: int, offset: int, data, evict: bool = True) -> None:
    """Write at an offset of an open file, then drop those pages from the cache."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
    if evict:
        os.fdatasync(fd)
        _evict(fd, offset, len(view))
