"""Asynchronous loads and stores, so that I/O overlaps compute (Algorithm 1 of the paper).

One worker thread runs the transfers in submission order, which keeps a store ahead of
any later load of the same data. Disk reads and torch copies release the GIL, so the
worker really runs beside the compute thread. On CUDA the worker issues its copies on
its own stream. With overlap off, every transfer runs inline, as the paper's ablation.

Each transfer may name its `kind` (e.g. "decode_load_cache"): its run time is added to
`timers[kind]`, which with overlap off gives the paper's runtime breakdown (Table 23).
Each key is written by one thread only (the worker, or the caller when inline).
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class _Done:
    """A finished future, for inline (no-overlap) execution."""

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value


class CopyEngine:
    def __init__(self, overlap: bool, device: torch.device, timers: dict | None = None):
        self.overlap = overlap
        self.timers = timers if timers is not None else defaultdict(float)
        self.cuda = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexgen-io") if overlap else None
        self._stream = torch.cuda.Stream(device) if (overlap and self.cuda) else None

    def submit(self, fn, *args, kind: str | None = None) -> Future | _Done:
        if self._pool is None:
            return _Done(self._timed(kind, self._inline, fn, args))
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()  # the transfer may read tensors that compute just produced
        return self._pool.submit(self._timed, kind, self._run, fn, args, ready)

    def _timed(self, kind, run, *args):
        if kind is None:
            return run(*args)
        t0 = time.perf_counter()
        out = run(*args)
        self.timers[kind] += time.perf_counter() - t0
        return out

    def _inline(self, fn, args):
        out = fn(*args)
        if self.cuda:  # non_blocking copies: the time is only known once they finish
            torch.cuda.current_stream().synchronize()
        return out

    def _run(self, fn, args, ready):
        if not self.cuda:
            return fn(*args)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            out = fn(*args)
        self._stream.synchronize()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def consume(value, device: torch.device):
    """Make tensors from the copy stream safe to use (and free) on the compute stream."""
    if device.type == "cuda":
        for t in _tensors(value):
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream())
    return value


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
