"""Free disk space, checked against what a write needs before the write starts, and the
one message a full disk gets wherever it happens (offload files, weight stores, HELM
outputs): the path, the bytes needed, the bytes free, and what to do."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from flexgen_helm.errors import DiskFullError

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def disk_full(path: str | os.PathLike, needed: int | None, what: str, advice: str) -> DiskFullError:
    """The error for a write of `needed` bytes (None: more than is free, size unknown) that
    does not fit."""
    need = "more than is free" if needed is None else size_text(needed)
    return DiskFullError(f"disk full: {what} at {path} needs {need}, {size_text(free_bytes(path))} free; {advice}")


def check_free_space(path: str | os.PathLike, needed: int, what: str, advice: str) -> None:
    """Raise a DiskFullError before a write of `needed` bytes that cannot fit."""
    if needed > free_bytes(path):
        raise disk_full(path, needed, what, advice)


def is_disk_full(exc: BaseException) -> bool:
    """An OSError of a full disk or quota, or SQLite's report of one."""
    if isinstance(exc, OSError):
        return exc.errno in FULL_ERRNOS
    return type(exc).__name__ in ("OperationalError", "DatabaseError") and "full" in str(exc).lower()
