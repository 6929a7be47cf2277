"""Keep freed host memory in the process instead of handing it back to the OS.

glibc serves big allocations (a layer's activations, a GPU batch's MLP output) with fresh
mmap'd pages and trims freed heap memory back to the OS, so every such tensor is paid for
again in page faults on first touch: on a CPU-only machine that was a third of a prefill
(OPT-1.3B, 4 x 256 tokens, bfloat16: 2.50 s -> 1.61 s with this, measured with
torch.profiler; ReLU over a 1024 x 8192 output 11.9 -> 3.2 ms). Raising glibc's mmap and trim
thresholds makes freed blocks reusable, as a caching allocator would. The cost: the
process's resident memory does not shrink after a peak.

Off with FLEXGEN_HELM_KEEP_FREED_MEMORY=0; a no-op where the C library is not glibc."""

from __future__ import annotations

import ctypes
import os

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# blocks above this stay mmap'd; glibc 2.36 accepts 1 GiB, older ones cap at 32 MiB (mallopt fails)
_MMAP_THRESHOLDS = (1 << 30, 32 << 20)
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only beyond 2 GiB of free heap top

_applied = False


def keep_freed_host_memory() -> bool:
    """Apply once per process; True when glibc accepted both settings."""
    global _applied
    if _applied or os.environ.get("FLEXGEN_HELM_KEEP_FREED_MEMORY", "1") == "0":
        return _applied
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mmap_ok = any(mallopt(_M_MMAP_THRESHOLD, t) for t in _MMAP_THRESHOLDS)
    _applied = mmap_ok and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _applied
