"""Asynchronous loads and stores, so that I/O overlaps compute (Algorithm 1 of the paper).

Two lanes, one worker thread each. The "batches" lane runs a GPU batch's cache and
hidden-state transfers in submission order, which keeps a store ahead of any later load
of the same data. The "weights" lane runs weight loads: weights are only read, so their
order against the rest does not matter, and on a lane of their own the next layer's
weight read no longer holds up the small loads a batch needs now (on one lane every
batch's hidden-state load queued behind it, so the reads and the compute took turns:
OPT-1.3B, weights on disk, decode time = weight read + compute). Disk reads and torch
copies release the GIL, so the workers really run beside the compute thread. On CUDA each
lane issues its copies on its own stream. With overlap off, every transfer runs inline,
as the paper's ablation.

A load made of many small reads (a merged decode step reads a group of GPU batches' KV cache of a
layer off the disk at once) issues them together with `fan_out`: a small O_DIRECT read
waits its turn behind the weight lane's large ones, and one at a time each paid that wait
(the 2-core EPYC's virtio disk, 400 KB reads beside a stream of 64 MiB ones: 15.6 ms a
read one at a time, 3.5 ms with 4 in flight, 1.4 ms with 16).

Each transfer may name its `kind` (e.g. "decode_load_cache"): its run time is added to
`timers[kind]`, which with overlap off gives the paper's runtime breakdown (Table 23).
Each key is written by one thread only (the worker, or the caller when inline).

On a GPU, with nothing on disk, the copies go instead on the lanes' streams from the caller's
own thread (`on_streams`, FlexGen's own way; FLEXGEN_HELM_CUDA_COPIES=streams, the default): no
worker thread and no wait on the host. Each transfer's stream waits on the GPU for what
compute made before it, and compute waits on the GPU for what a load brought (the host
waits only for data it reads itself, in RAM). Why: a GPU's step is bound by the host, and the
worker threads held up the thread that queues the GPU's work (each transfer's hand-off, and
the worker's wait for its copy). On an H200, OPT-1.3B from RAM: overlap with threads ran at
0.67x and 0.91x of overlap off, with streams at 1.32x (runs/gpu/h200-2026-11-28/README.md,
section 2; runs/gpu/h200-2026-11-29/README.md). A disk read blocks the thread that makes it,
so with anything on disk the worker threads stay; so they do where the host itself reads what
a lane stored in RAM (executor/transfer_ways.py). FLEXGEN_HELM_CUDA_COPIES=threads puts
every GPU's copies on the workers. Here the timers hold the host's time to issue a transfer,
not the copy's. Streams are always the compute device's own (`current_stream(device)`),
whichever device is the thread's current one (a pipeline stage's cuda:N).
"""

from __future__ import annotations

import functools
import os
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


class _OnStream:
    """A transfer issued on a lane's stream (CopyEngine.on_streams): result() makes the
    caller's stream wait for it on the GPU, or, where the answer holds tensors in RAM that
    the host will read, waits for it on the host."""

    def __init__(self, value, done: torch.cuda.Event, device: torch.device):
        self._value, self._done, self._device = value, done, device

    def result(self):
        if any(not t.is_cuda for t in _tensors(self._value)):
            self._done.synchronize()
        else:
            torch.cuda.current_stream(self._device).wait_event(self._done)
        return self._value


LANES = ("batches", "weights")
READS_AT_ONCE = 16  # the most reads fan_out has in flight (the measurement above)
CUDA_COPY_WAYS = ("streams", "threads")
COPIES_SETTING = "FLEXGEN_HELM_CUDA_COPIES"  # the environment variable that chooses one


def cuda_copies() -> str:
    """How a GPU's transfers overlap compute where nothing is on disk (module doc):
    FLEXGEN_HELM_CUDA_COPIES, "streams" (the default) or "threads"."""
    way = os.environ.get(COPIES_SETTING, "streams")
    if way not in CUDA_COPY_WAYS:
        raise ValueError(f"{COPIES_SETTING}={way!r}: expected one of {', '.join(CUDA_COPY_WAYS)}")
    return way


class CopyEngine:
    def __init__(self, overlap: bool, device: torch.device, timers: dict | None = None, on_streams: bool = False):
        """on_streams: a GPU's copies issued on the lanes' streams by the caller (module doc);
        only where nothing is read from or written to disk."""
        self.overlap = overlap
        self.timers = timers if timers is not None else defaultdict(float)
        self.cuda = device.type == "cuda"
        self.device = device  # the compute device: its current stream is compute's, whichever device is current
        if on_streams and not (overlap and self.cuda):
            raise ValueError("copies on streams need overlap on a GPU")
        self.on_streams = on_streams
        self._pools = {lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flexgen-io-{lane}")
                       for lane in LANES} if overlap and not on_streams else None
        self._streams = {lane: torch.cuda.Stream(device) for lane in LANES} if (overlap and self.cuda) else None
        self._fan: ThreadPoolExecutor | None = None

    def submit(self, fn, *args, kind: str | None = None, lane: str = "batches") -> Future | _Done | _OnStream:
        """Run fn(*args) on `lane` (module doc); its run time goes to timers[kind]."""
        if self.on_streams:
            return self._timed(kind, self._issue, fn, args, lane)
        if self._pools is None:
            return _Done(self._timed(kind, self._inline, fn, args))
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))  # the transfer may read what compute just made
        return self._pools[lane].submit(self._timed, kind, self._run, fn, args, ready, lane)

    def fan_out(self, fn, items: list) -> list:
        """[fn(x) for x in items], up to READS_AT_ONCE of them running at once (fn: reads that
        release the GIL and touch nothing the others touch). On CUDA each runs on the caller's
        stream (a lane's): a thread starts on the default stream, the compute stream, where
        what a read queued (a ring's gather of a GPU-tier cache) was not ordered with the lane
        that uses it, nor covered by the lane's wait."""
        if len(items) < 2 or self.on_streams:  # (on streams nothing is on disk: reads are views and copies)
            return [fn(x) for x in items]
        if self._fan is None:
            self._fan = ThreadPoolExecutor(max_workers=READS_AT_ONCE, thread_name_prefix="flexgen-io-fan")
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        return list(self._fan.map(functools.partial(_on_stream, stream, fn), items))

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
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def _run(self, fn, args, ready, lane: str):
        if not self.cuda:
            return without_autograd(fn, *args)
        stream = self._streams[lane]
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            out = without_autograd(fn, *args)
        stream.synchronize()
        return out

    def _issue(self, fn, args, lane: str) -> _OnStream:
        """fn(*args) queued on the lane's stream by the caller (on_streams): after what the
        caller's stream has queued so far (the tensors compute just made), its GPU inputs kept
        from reuse until the lane has read them."""
        stream = self._streams[lane]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in _tensors(args):
            if t.is_cuda:
                t.record_stream(stream)
        with torch.cuda.stream(stream):
            out = without_autograd(fn, *args)
        done = torch.cuda.Event()
        done.record(stream)
        return _OnStream(out, done, self.device)

    def close(self) -> None:
        for pool in [*(self._pools or {}).values(), *([self._fan] if self._fan else [])]:
            pool.shutdown(wait=True)
        if self.on_streams:  # what the lanes still had queued (the last stores) lands before the block ends
            for stream in self._streams.values():
                stream.synchronize()


def without_autograd(fn, *args):
    """fn(*args) in torch's inference mode, which is per thread: the engine's tensors never need
    autograd, and skipping its per-op bookkeeping (version counters, view tracking) measured
    ~10% of a decode step made of many small ops (the main job's 4-bit LAMBADA, 2-core EPYC).
    The executor's entry points (executor/generation.py) and every worker thread here run so."""
    with torch.inference_mode():
        return fn(*args)


def _on_stream(stream, fn, x):
    """fn(x) without autograd, its CUDA work queued on `stream` (None: no CUDA)."""
    if stream is None:
        return without_autograd(fn, x)
    with torch.cuda.stream(stream):
        return without_autograd(fn, x)


def consume(value, device: torch.device):
    """Make tensors from the copy stream safe to use (and free) on the compute stream."""
    if device.type == "cuda":
        for t in _tensors(value):
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(device))
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
