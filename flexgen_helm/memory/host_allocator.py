"""Keep freed host memory in the process instead of handing it back to the OS.

glibc serves big allocations (a layer's activations, a GPU batch's MLP output) with fresh
mmap'd pages and trims freed heap memory back to the OS, so every such tensor is paid for
again in page faults on first touch: on a CPU-only machine that was a third of a prefill
(OPT-1.3B, 4 x 256 tokens, bfloat16: 2.50 s -> 1.61 s with this, measured with
torch.profiler; ReLU over a 1024 x 8192 output 11.9 -> 3.2 ms). Raising glibc's mmap and trim
thresholds makes freed blocks reusable, as a caching allocator would.

The cost: freed blocks stay resident, and where they are interleaved with live ones the heap
fragments, so kept forever they outgrow what the run uses (OPT-1.3B, 4 GPU batches of 32 x 128
tokens, weights 76% in RAM: 1.0-1.3 GiB of freed memory resident beside 2.2 GiB in use,
runs/bench/memory). So `release_freed_host_memory` hands the freed pages back (malloc_trim:
holes too, every arena) once more than a given amount of them is resident: the schedule keeps
about two GPU batches' working sets and a layer's weight-load buffers, which the next layers
reuse (executor/working_set.py).

Off with FLEXGEN_HELM_KEEP_FREED_MEMORY=0; a no-op where the C library is not glibc."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

from flexgen_helm.memory.usage import resident_anonymous_bytes

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# blocks above this stay mmap'd; glibc 2.36 accepts 1 GiB, older ones cap at 32 MiB (mallopt fails)
_MMAP_THRESHOLDS = (1 << 30, 32 << 20)
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only beyond 2 GiB of free heap top

_applied = False
_mmap_threshold = 0  # the one glibc accepted (keep_freed_host_memory)
_not_malloc_bytes = 0  # anonymous resident memory malloc does not hand out (Python's own arenas, stacks)
_untrimmable = 0  # freed-looking resident memory the last hand-back left (release_freed_host_memory)


class _MallInfo2(ctypes.Structure):  # malloc.h, glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def keep_freed_host_memory() -> bool:
    """Apply once per process; True when glibc accepted both settings."""
    global _applied, _not_malloc_bytes, _mmap_threshold
    if _applied or os.environ.get("FLEXGEN_HELM_KEEP_FREED_MEMORY", "1") == "0":
        return _applied
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    _mmap_threshold = next((t for t in _MMAP_THRESHOLDS if mallopt(_M_MMAP_THRESHOLD, t)), 0)
    mmap_ok = bool(_mmap_threshold)
    _applied = mmap_ok and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if _applied and _malloc_in_use() is not None:
        _not_malloc_bytes = max(0, resident_anonymous_bytes() - _malloc_in_use())
    return _applied


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def _malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not got back (its heaps' and its mmapped blocks'), or
    None where glibc cannot say (before 2.33)."""
    if not hasattr(_libc(), "mallinfo2"):
        return None
    info = _libc().mallinfo2()
    return info.uordblks + info.hblkhd


def heap_free_bytes() -> int:
    """Bytes of the heap's free chunks, resident or not (mallinfo2's fordblks; 0 where glibc
    cannot say)."""
    return _libc().mallinfo2().fordblks if hasattr(_libc(), "mallinfo2") else 0


def freed_resident_bytes() -> int:
    """Freed memory that malloc keeps resident for reuse (0 without the setting, or where
    glibc cannot say)."""
    in_use = _malloc_in_use() if _applied else None
    if in_use is None:
        return 0
    return max(0, resident_anonymous_bytes() - in_use - _not_malloc_bytes)


def release_freed_host_memory(keep_bytes: int) -> bool:
    """Hand freed memory back to the OS when more than `keep_bytes` of it is resident beyond
    what the last hand-back left (freed_beyond, then hand_back_freed_memory); True when it did."""
    return freed_beyond(keep_bytes) and hand_back_freed_memory()


def freed_beyond(keep_bytes: int) -> bool:
    """Whether more than `keep_bytes` of freed memory is resident beyond what the last
    hand-back left: the look, which costs milliseconds (malloc walks its arenas). What a
    hand-back leaves (free bytes inside pages still in use, anonymous memory that grew after
    keep_freed_host_memory measured what is not malloc's: ~25 MiB in a SmolLM2 HELM run) is
    no reason for the next one, which could not return it either: counted in, every check
    trimmed (5 ms each, every 50 ms) and the layers after it faulted their memory in again."""
    return freed_resident_bytes() > keep_bytes + _untrimmable


def hand_back_freed_memory() -> bool:
    """malloc_trim: every arena's whole free pages go back to the OS (blocks still in use stay
    where they are; the next allocations there fault them in again); True when any went."""
    global _untrimmable
    done = bool(_libc().malloc_trim(0))
    _untrimmable = freed_resident_bytes()
    return done


@contextlib.contextmanager
def big_allocations_outside_heap(min_bytes: int = 256 << 10) -> Iterator[None]:
    """Inside, an allocation of at least `min_bytes` that the heap's free chunks cannot serve
    gets a mapping of its own, handed back to the OS whole when freed, instead of growing the
    heap. For work that leaves long-lived tensors between its freed temporaries (the dense
    copies made at load: each dequantized, packed into a new buffer, then dropped): in the
    heap those temporaries stay behind as holes between the live tensors (156 MB of them after
    the 4-bit SmolLM2 deployment's load), which the run's activations then wander over,
    faulting pages in until a look hands them back, over and over: its prefill took 1.1-1.2x
    BF16's on the same dense copies (runs/compression_8bit/load_holes/). The price: the
    temporaries' pages are faulted in afresh for each tensor. A no-op where
    keep_freed_host_memory is not applied."""
    if not _applied:
        yield
        return
    mallopt = _libc().mallopt
    mallopt(_M_MMAP_THRESHOLD, min_bytes)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _mmap_threshold)
