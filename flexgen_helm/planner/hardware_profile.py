"""The speeds and sizes of this machine that the cost model needs (the paper's profiler):
measured once by `flexgen-helm profile`, saved as JSON, refittable from bench runs
(policy/refit.py).

Every speed is measured with the operations the engine itself runs: weight reads go
through memory/direct_io.py with the page cache bypassed, attention through the
executor's `attend`, dequantization through compression.dequantize, 4-bit weights through
the int4 kernel the engine multiplies them with (compression/int4.py's CompressedWeight)."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.compression.int4 import clear_kernel_over_kept_rows, set_kernel_over_kept_rows, set_max_kernel_rows
from flexgen_helm.compression.int8 import set_max_kernel_rows as set_max_int8_kernel_rows
from flexgen_helm.dense_linear import NO_ROWS, flipped_linear, flips, set_flipped_rows
from flexgen_helm.errors import ProfileFormatError
from flexgen_helm.executor.attention import (
    FUSED_DECODE,
    FUSED_PREFIX_PART,
    PREFIX_PART_USES,
    attend,
    attend_past_shared_prefix,
    attend_window_past_shared_prefix,
    prefix_for_decode,
    set_fused_decode,
    set_fused_prefix_part,
)
from flexgen_helm.memory.devices import DTYPE_NAMES, DTYPES
from flexgen_helm.memory.direct_io import set_reads_in_flight
from flexgen_helm.memory.disk_speed import fastest_direct
from flexgen_helm.memory.machine import machine_info, machine_label, same_machine
from flexgen_helm.weights.registry import default_cache_dir

logger = logging.getLogger(__name__)
_TOLD_UNMEASURED: set[str] = set()  # profiles (by when measured) use_profile said this of, once each

# /2: fixed costs and the disk's ways of reading; /3: the int4 kernel's speed by row count;
# /4: a decode step's attention over a memory tier's cache read in place (a view of its slot)
# /5: 4-bit dequantization at the speed of its one-addcmul form (compression/int4.py)
# /6: a bf16 decode step's attention on both of its paths (executor/attention.fused_decode), and
# its part past a shared prefix on both (FUSED_PREFIX_PART)
# /7: every speed sustained over its measurement (the mean call), not its fastest call (_timed)
# /8: the shared prefix's part on both paths timed apart for decode steps and prefill windows
FORMAT = "flexgen-helm-hardware/8"
FORMAT_MEASURES = ("a shared prefix's part of attention on both of its paths, timed apart for a decode step and a "
                   "prefill window, where /7 kept the smaller gain of the two")

# Activation rows of the profiled Linear: 1-64 are decode (one token per sequence of a GPU
# batch), 256-4096 prefill (a GPU batch times the prompt). The weight is (4096, 2048): big
# enough to stream from memory like a real layer's, small enough to profile in seconds.
MATMUL_ROWS = (1, 4, 16, 64, 256, 1024, 4096)
MATMUL_ROWS_FP32 = (1, 16, 256, 1024)
MATMUL_SHAPE = (4096, 2048)  # (out, in)
# 32 x 16 MiB (bf16) = 512 MiB, several times any last-level cache (a server CPU's shared L3
# reaches ~100 MiB: 8 weights were partly served from it and made decode look 2x faster)
STREAMED_WEIGHTS = 32
# decode attention's caches, read one after another: 8 layers x 32 MiB (bf16), several times a
# desktop's last-level cache; one cache read again and again sat partly in this project's
# EPYC's 32 MiB and measured 16.9 GB/s, where the engine reaches ~12 over OLMoE's
DECODE_CACHE_LAYERS = 8
# Keys at which a bf16 decode step's attention is timed on both of its paths
# (executor/attention.fused_decode): a shared-prefix block's own keys up to a long prompt's;
# on units of one query head (OPT's, OLMoE's) and of three (grouped-query heads, SmolLM2's 32
# sequences), the smaller gain of the two: on a 2-core Xeon the fused kernel gained 1.76-1.88x
# on the first at 513 keys and lost on the second at 24 (0.82-0.86x: runs/bench/decode_attention_paths)
FUSED_DECODE_KEYS = (32, 128, 512)
FUSED_DECODE_UNITS = ((256, 1), (96, 3))  # (units, query heads a unit)
MAX_STREAMED_ROWS = 64  # above this the product is compute-bound: one (cached) weight will do
# Activation rows of the profiled int4 kernel (4-bit weights, groups of 64 along the input dim):
# decode-sized up to prefill-sized, past where the kernel loses to dequantize-then-matmul on a CPU
# (runs/bench/compression/kernel_crossover.py: between 128 and 256 rows on an AVX512-BF16 EPYC)
KERNEL_ROWS = (1, 8, 32, 128, 512)
KERNEL_GROUP_SIZE = 64
# Decode-sized row counts at which a CPU's products are timed both ways (dense_linear.py:
# F.linear's x W^T, and W x^T) on streamed weights; the second runs on the band where it pays.
# Dense enough to find both ends of that band: on a 2-core AVX-512 Xeon every shape measured
# lost at 2 rows and gained at 16-48, and SmolLM2's lost from 64 (by shape:
# runs/bench/linear_orientation/band_2026-11-27.jsonl; the profile's band, 8-48: results.jsonl there).
FLIPPED_ROW_COUNTS = (2, 4, 8, 16, 32, 48, 64, 96, 128)
# ... on two layer shapes, a gain counted where both gain: MATMUL_SHAPE, and a small model's
# MLP (SmolLM2's), whose products lost to F.linear at 64 rows where MATMUL_SHAPE's broke even
FLIPPED_SMALL_SHAPE = (1536, 576)
FLIPPED_STREAMED_BYTES = 256 << 20
FLIPPED_MIN_GAIN = 1.05  # a gain smaller than this is within a shared machine's noise
# Decode-sized row counts at which a compressed weight's kernel is timed against its dense copy
# held in memory (compression/int4.KERNEL_OVER_KEPT_ROWS), on FLIPPED_SMALL_SHAPE and
# MATMUL_SHAPE weights streamed (FLIPPED_STREAMED_BYTES of copies), the smaller gain of the two
KEPT_KERNEL_ROWS = (1, 2, 4, 8, 16, 32)


@dataclass
class DeviceSpeeds:
    """What one compute device (the CPU, or a GPU) sustains."""

    # dtype name -> rows -> FLOP/s of F.linear(x (rows, in), w (out, in)); interpolated in log(rows)
    matmul_flops: dict[str, dict[int, float]] = field(default_factory=dict)
    attn_prefill_flops: float = 1e11  # causal attention over a prompt, counted as the full s x s
    attn_decode_bytes_per_s: float = 5e9  # bytes of K and V cache one decode attention step gets through
    # keys (FUSED_DECODE_KEYS) -> time of a bfloat16 decode step's attention on attend()'s
    # float32 path over its time on torch's fused kernel (executor/attention.fused_decode),
    # timed in pairs; the engine takes the fused one from fused_decode_from_keys() on, and
    # attn_decode_bytes_per_s is the path it takes at 512 keys. Empty: not measured (another
    # dtype, a GPU's own attention, a profile from before)
    attn_decode_fused_gains: dict[int, float] = field(default_factory=dict)
    # use (executor/attention.PREFIX_PART_USES: a decode step's whole call, a few-shot prefill
    # window's part) -> time of a bf16 shared prefix's part of attention on our products over
    # its time on torch's fused kernel (attention.FUSED_PREFIX_PART), timed in pairs; each use
    # takes the kernel above FLIPPED_MIN_GAIN. Empty: not measured (another dtype, a CPU
    # without bf16 arithmetic, a GPU)
    attn_prefix_fused_gains: dict[str, float] = field(default_factory=dict)
    dequant_elems_per_s: float = 1e9  # 4-bit groups (QuantizedTensor) turned back into the compute dtype
    # 4-bit weights in the int4 kernel's packed layout (compression/int4.py), in the profile's
    # dtype: rows -> FLOP/s of the kernel's matmul (interpolated in log(rows)), and elements/s of
    # dequantizing them (the dense copy above the crossover); empty / 0 where the kernel does not
    # run (another dtype than bfloat16, a CPU whose packed layout the engine does not decode)
    int4_matmul_flops: dict[int, float] = field(default_factory=dict)
    int4_dequant_elems_per_s: float = 0.0
    # the same for 8-bit weights per output channel in the int8 kernel's layout (compression/int8.py)
    int8_matmul_flops: dict[int, float] = field(default_factory=dict)
    int8_dequant_elems_per_s: float = 0.0
    # one elementwise pass (an activation function, a residual add, a copy) over activations in
    # the compute dtype, elements/s: the block's work besides its matmuls and attention
    elementwise_elems_per_s: float = 1e9
    op_latency_s: float = 1e-5  # a tiny kernel: the floor under every op of a layer
    # the engine's fixed costs (planner/overhead_profile.py): family -> phase -> {"per_layer_batch",
    # "per_step"} seconds, and for "moe" "per_expert" (each expert a block's call touches); empty in
    # a hand-made profile, where the cost model counts ops x op_latency_s
    fixed_costs: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    copy_handoff_s: float = 0.0  # one transfer handed to the copy thread and waited for
    # dtype name -> rows (FLIPPED_ROW_COUNTS) -> time of F.linear over time of the same product as
    # W x^T (dense_linear.py), on streamed weights (the smaller of two shapes' gains);
    # empty where not measured (a GPU)
    flipped_gains: dict[str, dict[int, float]] = field(default_factory=dict)
    # kernel ("int4", "int8") -> rows (KEPT_KERNEL_ROWS) -> time of the product on a dense copy
    # held in memory (packed where the engine packs it) over time of the kernel's on the codes,
    # in the profile's dtype; empty where not measured (a GPU, a dtype no kernel takes)
    kernel_over_kept_gains: dict[str, dict[int, float]] = field(default_factory=dict)

    def fused_prefix_part_uses(self) -> frozenset[str]:
        """The uses of a shared prefix's part that take the fused kernel (FUSED_PREFIX_PART)."""
        return frozenset(use for use, gain in self.attn_prefix_fused_gains.items() if gain > FLIPPED_MIN_GAIN)

    def fused_decode_from_keys(self) -> int | None:
        """The fewest keys measured from which the fused kernel gained at every count measured
        above it too (None: at none, or not measured)."""
        return _fused_decode_from_keys(self.attn_decode_fused_gains)

    def kernel_over_kept_rows(self, kernel: str) -> int:
        """The most rows up to which `kernel` beat the held dense copy at every measured row
        count from the fewest (by FLIPPED_MIN_GAIN); 0 where it did not at the fewest, or was
        not measured."""
        best = 0
        for rows, gain in sorted(self.kernel_over_kept_gains.get(kernel, {}).items()):
            if gain < FLIPPED_MIN_GAIN:
                break
            best = rows
        return best

    def kernel_over_kept_gain(self, kernel: str, rows: int) -> float:
        """How many times faster `kernel` multiplies `rows` rows than a held dense copy, where the
        engine takes it (kernel_over_kept_rows; interpolated in log(rows)); 1.0 where it does not."""
        if rows > self.kernel_over_kept_rows(kernel):
            return 1.0
        return _interpolate_log(self.kernel_over_kept_gains[kernel], rows)

    def linear_flops(self, dtype: str, rows: int) -> float:
        """FLOP/s of a linear layer's product of `rows` rows with a dense weight, as the engine
        multiplies it (dense_linear.py: W x^T on the flipped_rows band)."""
        table = self.matmul_flops.get(dtype) or next(iter(self.matmul_flops.values()), {1: 1e10})
        gains = self.flipped_gains.get(dtype, {})
        flipped = flips(rows, self.flipped_rows(dtype))
        return _interpolate_log(table, rows) * (_interpolate_log(gains, rows) if flipped else 1.0)

    def flipped_rows(self, dtype: str) -> tuple[int, int]:
        """The (fewest, most) rows of the longest run of consecutive measured row counts at
        which W x^T was faster than F.linear (by FLIPPED_MIN_GAIN; the first such run where two
        are as long); NO_ROWS where it never was or was not measured. Row counts between two
        measured ones inside the band are taken to gain too; those past its ends are not. A
        profile timed at fewer row counts than FLIPPED_ROW_COUNTS (before the band: one shape,
        2, 4, 16, 64 and 128 rows) keeps the rule it was taken for, the run from its fewest
        rows: on the AVX-512 Xeon its one shape gained at 64-128 rows where SmolLM2's lost."""
        gains = sorted(self.flipped_gains.get(dtype, {}).items())
        runs, run = [], []
        for rows, gain in gains:
            if rows > 1 and gain >= FLIPPED_MIN_GAIN:
                run.append(rows)
            elif run:
                runs, run = runs + [run], []
        runs.append(run)
        if not self.flipped_band_measured(dtype):
            runs = [r for r in runs[:1] if r and r[0] == gains[0][0]]
        longest = max(runs, key=len, default=[])  # the first of equal lengths
        return (longest[0], longest[-1]) if longest else NO_ROWS

    def flipped_band_measured(self, dtype: str) -> bool:
        """Whether the orientation gains in `dtype` were timed at every FLIPPED_ROW_COUNTS."""
        return set(FLIPPED_ROW_COUNTS) <= set(self.flipped_gains.get(dtype, {}))

    def int4_flops(self, rows: int) -> float:
        """FLOP/s of the int4 kernel multiplying `rows` activation rows (int4_matmul_flops)."""
        return _interpolate_log(self.int4_matmul_flops, rows)

    def int8_flops(self, rows: int) -> float:
        """FLOP/s of the int8 kernel multiplying `rows` activation rows (int8_matmul_flops)."""
        return _interpolate_log(self.int8_matmul_flops, rows)

    def int4_kernel_max_rows(self, dtype: str) -> int | None:
        """The most activation rows at which the int4 kernel was measured faster than
        dequantizing the weight and multiplying in `dtype` (per call, as
        CompressedWeight.linear chooses): 0 where it never is or was not measured, None where
        it won at every row count measured (the kernel then takes them all)."""
        return self._kernel_max_rows(self.int4_matmul_flops, self.int4_dequant_elems_per_s, dtype)

    def int8_kernel_max_rows(self, dtype: str) -> int | None:
        """As int4_kernel_max_rows, for the int8 kernel (compression/int8.py)."""
        return self._kernel_max_rows(self.int8_matmul_flops, self.int8_dequant_elems_per_s, dtype)

    def _kernel_max_rows(self, kernel_flops: dict[int, float], dequant_elems_per_s: float, dtype: str) -> int | None:
        if not kernel_flops or not dequant_elems_per_s:
            return 0
        best = 0
        for rows in sorted(kernel_flops):
            flop = 2 * rows  # per weight element
            kernel = flop / kernel_flops[rows]
            dequantize_then_matmul = 1 / dequant_elems_per_s + flop / self.linear_flops(dtype, rows)
            if kernel > dequantize_then_matmul:
                return best
            best = rows
        return None


@dataclass
class HardwareProfile:
    compute_device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "bfloat16"
    devices: dict[str, DeviceSpeeds] = field(default_factory=lambda: {"cpu": DeviceSpeeds()})
    # bytes/s; the host<->GPU links are 0 on a CPU-only machine, where a "cpu -> gpu" copy is a memcpy
    memcpy_bytes_per_s: float = 5e9
    h2d_pinned_bytes_per_s: float = 0.0
    h2d_pageable_bytes_per_s: float = 0.0
    d2h_pinned_bytes_per_s: float = 0.0
    d2h_pageable_bytes_per_s: float = 0.0
    # the engine's reader: the faster O_DIRECT way (disk_reads_in_flight), page cache bypassed
    disk_read_bytes_per_s: float = 1e9
    # the device's read bandwidth: the best way of reading it (memory/disk_speed.py), and each way's
    disk_device_read_bytes_per_s: float = 0.0
    disk_read_modes: dict[str, float] = field(default_factory=dict)
    disk_write_bytes_per_s: float = 5e8
    disk_read_latency_s: float = 2e-4  # one small O_DIRECT read (a bias, a norm)
    # phase -> the fraction of the shorter of (disk transfers, compute) that does not hide
    # behind the longer when both run at once: 0 = perfect overlap, 1 = they take turns.
    # Measured on a CPU-only machine, where the cores that compute also serve the reads
    # (a 2-core EPYC: 0.6 beside prefill-sized matmuls, 0.8 beside decode-sized ones)
    disk_overlap_loss: dict[str, float] = field(default_factory=dict)
    # capacities, bytes
    gpu_mem_bytes: int = 0
    cpu_mem_bytes: int = 0  # total RAM
    cpu_available_bytes: int = 0  # RAM available when profiled
    disk_free_bytes: int = 0
    offload_dir: str = ""
    process_baseline_bytes: int = 0  # RSS of a process that has imported torch and the engine
    # refit multipliers on the cost model's terms, "phase.resource" -> factor (policy/refit.py)
    time_scale: dict[str, float] = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    measured_at: str = ""
    format: str = FORMAT

    @property
    def compute(self) -> DeviceSpeeds:
        return self.devices[self.compute_device]

    @property
    def cpu(self) -> DeviceSpeeds:
        return self.devices["cpu"]

    @property
    def is_cuda(self) -> bool:
        return self.compute_device == "cuda"

    @property
    def disk_reads_in_flight(self) -> int:
        """The O_DIRECT reads at once the engine's disk reader uses on this machine: the
        faster way measured (memory/disk_speed.py)."""
        return fastest_direct(self.disk_read_modes)[0]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        d = dict(d)
        devices = {}
        for name, s in d.pop("devices", {}).items():
            s = dict(s)
            s["matmul_flops"] = {dt: {int(m): float(f) for m, f in t.items()}
                                 for dt, t in s.get("matmul_flops", {}).items()}
            for kernel in ("int4_matmul_flops", "int8_matmul_flops", "attn_decode_fused_gains"):
                s[kernel] = {int(m): float(f) for m, f in s.get(kernel, {}).items()}
            for tables in ("flipped_gains", "kernel_over_kept_gains"):
                s[tables] = {name: {int(m): float(g) for m, g in t.items()} for name, t in s.get(tables, {}).items()}
            devices[name] = DeviceSpeeds(**s)
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(devices=devices or {"cpu": DeviceSpeeds()}, **known)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        path = Path(path) if path else default_profile_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "HardwareProfile":
        """The profile saved at `path`; one of another format is an error that says so (it
        lacks what this one measures: the cost model would plan with made-up speeds)."""
        path = Path(path or default_profile_path())
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT:
            raise ProfileFormatError(f"{_other_format(path, d)}: measure this machine again with "
                                     f"`flexgen-helm profile --json {path}`")
        return cls.from_dict(d)


def default_profile_path() -> Path:
    return default_cache_dir() / "hardware.json"


def load_or_profile(path: str | os.PathLike | None = None, offload_dir: str | None = None,
                    verbose: bool = True) -> HardwareProfile:
    """The saved profile, or a fresh one (saved) when there is none or the saved one was
    measured on other hardware (a home directory, and its cache, can move between hosts)."""
    p = Path(path) if path else default_profile_path()
    saved, reason = _saved_profile(p)
    if saved is not None:
        return saved
    if verbose:
        print(f"{reason}: profiling this machine, {machine_label()} (under a minute)...", flush=True)
    prof = measure(offload_dir=offload_dir)
    prof.save(p)
    return prof


def saved_profile(path: str | os.PathLike | None = None) -> tuple[HardwareProfile | None, str]:
    """The profile saved for this machine (at `path`, default the user's), measuring nothing:
    else None and why there is none."""
    return _saved_profile(Path(path) if path else default_profile_path())


def _saved_profile(p: Path) -> tuple[HardwareProfile | None, str]:
    """The profile saved at `p` if it is of this format and this machine, else None and why not."""
    if not p.exists():
        return None, f"no hardware profile at {p}"
    d = json.loads(p.read_text())
    if d.get("format") != FORMAT:
        return None, _other_format(p, d)
    saved = HardwareProfile.from_dict(d)
    if saved.machine and not same_machine(saved.machine, machine_info()):
        return None, f"the profile at {p} was measured on {machine_label(saved.machine)}"
    return saved, ""


def _other_format(path: Path, d: dict) -> str:
    return (f"the hardware profile at {path} is of format {d.get('format')}, without what {FORMAT} measures "
            f"({FORMAT_MEASURES})")


def use_profile(path: str | os.PathLike | None = None) -> HardwareProfile | None:
    """Set what the engines this process loads choose by this machine's saved profile: the
    disk tier's reader (memory/direct_io.py) reads the way measured faster, and 4-bit weights
    take the int4 kernel up to the crossover measured on the compute device
    (compression/int4.py), decode-sized products run as W x^T where that was measured
    faster (dense_linear.py), and bfloat16 decode steps' attention takes torch's fused kernel
    where that was (executor/attention.fused_decode). Returns that profile, or None (the
    defaults stay) without a saved profile of this machine. Measures nothing: `flexgen-helm
    profile` (or --policy auto) does."""
    saved, _ = _saved_profile(Path(path) if path else default_profile_path())
    if saved is None:
        return None
    if saved.disk_read_modes:
        set_reads_in_flight(saved.disk_reads_in_flight)
    if saved.compute.int4_matmul_flops:
        set_max_kernel_rows(saved.compute_device, saved.compute.int4_kernel_max_rows(saved.dtype))
    if saved.compute.int8_matmul_flops:  # a profile from before the int8 kernel keeps its default
        set_max_int8_kernel_rows(saved.compute_device, saved.compute.int8_kernel_max_rows(saved.dtype))
    clear_kernel_over_kept_rows()  # a profile without the measurement leaves none from an earlier one
    for kernel in saved.compute.kernel_over_kept_gains:
        set_kernel_over_kept_rows(saved.compute_device, kernel, DTYPES[saved.dtype],
                                  saved.compute.kernel_over_kept_rows(kernel))
    for name in saved.compute.flipped_gains:
        set_flipped_rows(saved.compute_device, DTYPES[name], saved.compute.flipped_rows(name))
    # the CPU's decode path: its own profile's, or a GPU profile's host attention (delegation);
    # the prefix part's kernel is timed in a CPU's profile only (a GPU profile leaves it off)
    host = saved.devices.get("cpu")
    set_fused_decode("cpu", None if host is None else host.fused_decode_from_keys())
    set_fused_prefix_part("cpu", () if host is None else host.fused_prefix_part_uses())
    # only a CPU's profile measures them (a GPU's GEMMs are not known to gain: measure_device)
    unmeasured = saved.compute_device == "cpu" and not saved.compute.flipped_gains
    before_band = saved.compute_device == "cpu" and not unmeasured and not all(
        saved.compute.flipped_band_measured(name) for name in saved.compute.flipped_gains)
    if (unmeasured or before_band) and saved.measured_at not in _TOLD_UNMEASURED:
        _TOLD_UNMEASURED.add(saved.measured_at)
        if unmeasured:
            logger.warning("the hardware profile of %s (measured %s) predates the measurement of decode "
                           "products' orientation (flipped_gains), so every product runs as F.linear; "
                           "`flexgen-helm profile` measures it (a few seconds more)",
                           machine_label(saved.machine), saved.measured_at)
        else:
            logger.warning("the hardware profile of %s (measured %s) timed decode products' orientation at too few "
                           "row counts to find the band where W x^T pays, so it runs from the fewest rows up to the "
                           "first that did not gain, as then; `flexgen-helm profile` measures the band",
                           machine_label(saved.machine), saved.measured_at)
    return saved


def _interpolate_log(table: dict[int, float], x: float) -> float:
    """Piecewise linear in log(x); flat beyond the measured range."""
    import math

    pts = sorted(table.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return pts[-1][1]


# ---- measuring ----------------------------------------------------------------------------

def _timed(fn, min_s: float = 0.4, min_reps: int = 5, sync=None) -> float:
    """Seconds of one call: the mean over the calls of a window of at least `min_s`, after a
    warm-up call. The mean, not the fastest, because the profile predicts runs a minute long:
    a shared host's products swing by 2x from one few-second window to the next, and its
    fastest call (2,327 GFLOP/s on the 2-core Xeon) ran 2.4x its sustained rate (957;
    runs/bench/matmul_sustained/results.jsonl)."""
    return 1.0 / _sustained_rates({"call": (fn, 1.0)}, min_s, min_reps, sync)["call"]


def _sustained_rates(jobs: dict, seconds: float, min_reps: int = 5, sync=None) -> dict:
    """Work per second of each job (key -> (fn, work of one call)): every job's calls summed,
    their time summed, over rounds that call each job once in turn until `seconds` have passed
    (and each job ran min_reps times), after a warm-up call of each. Interleaved, so that the
    jobs of one table share the host's good and bad moments and the table keeps its shape."""
    for fn, _ in jobs.values():
        fn()
    if sync:
        sync()
    busy = dict.fromkeys(jobs, 0.0)
    calls = dict.fromkeys(jobs, 0)
    start = time.perf_counter()
    while min(calls.values()) < min_reps or time.perf_counter() - start < seconds:
        for key, (fn, _) in jobs.items():
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            busy[key] += time.perf_counter() - t0
            calls[key] += 1
    return {key: work * calls[key] / busy[key] for key, (_, work) in jobs.items()}


def measure_device(device: torch.device, dtype: torch.dtype) -> DeviceSpeeds:
    from flexgen_helm.compression import dequantize, quantize
    from flexgen_helm.policy.policy import Compression

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    speeds = DeviceSpeeds()
    for dt, rows_list in ((dtype, MATMUL_ROWS), (torch.float32, MATMUL_ROWS_FP32)):
        if DTYPE_NAMES[dt] not in speeds.matmul_flops:  # the engine dtype may be float32 itself
            speeds.matmul_flops[DTYPE_NAMES[dt]] = _matmul_flops(device, dt, rows_list, sync)
    (speeds.attn_prefill_flops, speeds.attn_decode_bytes_per_s,
     speeds.attn_decode_fused_gains) = _attention_speeds(device, dtype, sync)
    speeds.attn_prefix_fused_gains = prefix_part_fused_gains(device, dtype)

    out_f, in_f = MATMUL_SHAPE
    wq = quantize(torch.randn(out_f, in_f, device=device).to(dtype), Compression(4, 64), 0)
    speeds.dequant_elems_per_s = out_f * in_f / _timed(lambda: dequantize(wq, dtype), sync=sync)
    speeds.int4_matmul_flops, speeds.int4_dequant_elems_per_s = _int4_speeds(device, dtype, sync)
    speeds.int8_matmul_flops, speeds.int8_dequant_elems_per_s = _int8_speeds(device, dtype, sync)
    if device.type == "cpu":  # a GPU's GEMMs are not known to gain (never measured on one)
        speeds.flipped_gains = {DTYPE_NAMES[dt]: _flipped_gains(device, dt) for dt in {dtype, torch.float32}}
        speeds.kernel_over_kept_gains = _kernel_over_kept_gains(device, dtype)
    speeds.elementwise_elems_per_s = measure_elementwise_rate(device, dtype, sync)
    tiny_x, tiny_w = torch.randn(1, 64, device=device).to(dtype), torch.randn(64, 64, device=device).to(dtype)
    speeds.op_latency_s = _timed(lambda: F.linear(tiny_x, tiny_w), min_reps=200, sync=sync)
    return speeds


def measure_host_attention(dtype: torch.dtype) -> DeviceSpeeds:
    """The host's speeds a GPU's plan reads: attention delegated to the CPU (cost_model.py);
    the host never multiplies a weight there. The whole CPU table in fp16 took 174 s on the
    2-core EPYC, time a GPU lease would pay for nothing; the GPU profile took 16 s on an H100's
    machine without it (runs/gpu/h100-2026-11-26)."""
    speeds = DeviceSpeeds()
    (speeds.attn_prefill_flops, speeds.attn_decode_bytes_per_s,
     speeds.attn_decode_fused_gains) = _attention_speeds(torch.device("cpu"), dtype, None)
    return speeds


def _cycled_linears(x: torch.Tensor, weights: list[torch.Tensor], n: int) -> None:
    """n linear layers on x, cycling through the weights."""
    for i in range(n):
        F.linear(x, weights[i % len(weights)])


# The product a comparison times its machine's compute speed with before each row: the
# MATMUL_SHAPE layer at a prefill's rows (tools/compare/run.with_compute_speed_now), sustained
# over SPEED_CHECK_SECONDS, since a shared host's rate holds for a few seconds at a time
SPEED_CHECK_ROWS = 1024
SPEED_CHECK_SECONDS = 4.0
# The seconds a rate table spends per entry, its entries timed in interleaved rounds
TABLE_SECONDS_PER_ENTRY = 0.6


def matmul_flops_now(profile: HardwareProfile, rows: int = SPEED_CHECK_ROWS) -> tuple[float, float]:
    """FLOP/s of the profile's compute device multiplying `rows` rows in the profile's dtype,
    measured now as the profile measured it (sustained), and the profile's own figure at
    those rows: a shared VM's CPU ran 10-22% slower in the afternoon than its morning profile
    (runs/compare/NOTES.md, 2026-11-28)."""
    device = torch.device(profile.compute_device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    now = _matmul_flops(device, DTYPES[profile.dtype], (rows,), sync, seconds=SPEED_CHECK_SECONDS)[rows]
    return now, _interpolate_log(profile.compute.matmul_flops[profile.dtype], rows)


def _matmul_flops(device: torch.device, dtype: torch.dtype, rows_list, sync, seconds: float | None = None
                  ) -> dict[int, float]:
    """FLOP/s of a MATMUL_SHAPE linear layer, by the number of rows multiplied, sustained over
    `seconds` (default: TABLE_SECONDS_PER_ENTRY per entry)."""
    out_f, in_f = MATMUL_SHAPE
    # Decode-sized products stream their weight from memory, as a real layer's do: cycle
    # through weights larger than any CPU cache together, or a cached weight flatters them.
    ws = [torch.randn(out_f, in_f, device=device).to(dtype) for _ in range(STREAMED_WEIGHTS)]
    return _linear_rates(ws, rows_list, device, dtype, sync, seconds)


def _linear_rates(ws: list, rows_list, device: torch.device, dtype: torch.dtype, sync, seconds: float | None
                  ) -> dict[int, float]:
    """FLOP/s of _linears over MATMUL_SHAPE weights ws (cycled through up to MAX_STREAMED_ROWS
    rows, one of them above), by rows, timed together (_sustained_rates)."""
    out_f, in_f = MATMUL_SHAPE
    jobs = {}
    for rows in rows_list:
        x = torch.randn(rows, in_f, device=device).to(dtype)
        group = ws if rows <= MAX_STREAMED_ROWS else ws[:1]
        jobs[rows] = (functools.partial(_linears, x, group), 2 * rows * in_f * out_f * len(group))
    if seconds is None:
        seconds = TABLE_SECONDS_PER_ENTRY * len(jobs)
    return _sustained_rates(jobs, seconds, sync=sync)


def _linears(x: torch.Tensor, weights: list) -> None:
    for w in weights:
        F.linear(x, w) if isinstance(w, torch.Tensor) else w.linear(x)


def _flipped_linears(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for w in weights:
        flipped_linear(x, w)


def _flipped_gains(device: torch.device, dtype: torch.dtype) -> dict[int, float]:
    """By FLIPPED_ROW_COUNTS: the time of F.linear over that of W x^T (dense_linear.flipped_linear)
    on weights streamed from memory, each row count timed both ways in turn, for MATMUL_SHAPE
    and FLIPPED_SMALL_SHAPE weights: the smaller gain of the two, so that the engine flips a
    product only where it paid for a large and a small model's layers alike."""
    per_shape = [flipped_gains_of(device, dtype, shape) for shape in (MATMUL_SHAPE, FLIPPED_SMALL_SHAPE)]
    return {rows: min(gains[rows] for gains in per_shape) for rows in FLIPPED_ROW_COUNTS}


def flipped_gains_of(device: torch.device, dtype: torch.dtype, shape: tuple[int, int],
                     rows_list=FLIPPED_ROW_COUNTS) -> dict[int, float]:
    """By rows_list: the gain of W x^T over F.linear for (out, in) `shape` weights streamed
    from memory (_flipped_gains; runs/bench/linear_orientation/band.py for other shapes)."""
    out_f, in_f = shape
    # 256 MiB of weights in any dtype, past a large server L3 (~100 MiB) as _matmul_flops's
    # weights are, in half of their time: the gain decides the engine's path, so it must not be
    # a cache's
    count = max(1, FLIPPED_STREAMED_BYTES // (out_f * in_f * torch.finfo(dtype).bits // 8))
    ws = [torch.randn(out_f, in_f, device=device).to(dtype) for _ in range(count)]
    gains = {}
    for rows in rows_list:
        x = torch.randn(rows, in_f, device=device).to(dtype)
        gains[rows] = paired_ratio(functools.partial(_linears, x, ws), functools.partial(_flipped_linears, x, ws))
    return gains


def _kernel_over_kept_gains(device: torch.device, dtype: torch.dtype) -> dict[str, dict[int, float]]:
    """By kernel that runs here in `dtype` and KEPT_KERNEL_ROWS: the gain of multiplying on the
    codes over multiplying on the dense copy a block keeps (compression/int4.CompressedWeight,
    its copy made and packed as executor/kept_weights.py keeps it), weights streamed from memory,
    the smaller gain of FLIPPED_SMALL_SHAPE's and MATMUL_SHAPE's."""
    from flexgen_helm.compression import int4, int8
    from flexgen_helm.compression.quantize import quantize
    from flexgen_helm.policy.policy import PER_CHANNEL, Compression

    packers = {"int4": (int4, Compression(4, KERNEL_GROUP_SIZE, 1), lambda q: int4.pack_int4(q, device)),
               "int8": (int8, Compression(8, PER_CHANNEL), lambda q: int8.pack_int8(q, dtype))}
    gains = {}
    for kernel, (module, cfg, pack) in packers.items():
        if module.device_refusal(dtype, device) is not None:
            continue
        per_shape = []
        for shape in (FLIPPED_SMALL_SHAPE, MATMUL_SHAPE):
            packed = pack(quantize(torch.randn(*shape, device=device).to(dtype), cfg, 1))
            count = max(1, FLIPPED_STREAMED_BYTES // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8))
            codes = [int4.CompressedWeight([(0, packed.clone())], shape, dtype, max_kernel_rows=None)
                     for _ in range(count)]
            kept = [int4.CompressedWeight([(0, packed)], shape, dtype, max_kernel_rows=None) for _ in range(count)]
            for w in kept:
                w.keep_dense()
                w.dense(by_column=False)
                w.pack_dense()
            table = {}
            for rows in KEPT_KERNEL_ROWS:
                x = torch.randn(rows, shape[1], device=device).to(dtype)
                table[rows] = paired_ratio(functools.partial(_held_copy_linears, x, kept),
                                           functools.partial(_kernel_linears, x, codes))
            per_shape.append(table)
        gains[kernel] = {rows: round(min(t[rows] for t in per_shape), 3) for rows in KEPT_KERNEL_ROWS}
    return gains


def _held_copy_linears(x: torch.Tensor, ws: list) -> None:
    for w in ws:
        w.held_copy_linear(x)


def _kernel_linears(x: torch.Tensor, ws: list) -> None:
    for w in ws:
        w.kernel_linear(x)


def paired_ratio(slow, fast, pairs: int = 5) -> float:
    """time(slow) / time(fast) as the median over pairs of calls made one right after the
    other (after a warm-up of each). Each side's own fastest call, taken apart, compared two
    moments of a shared machine: a profile of the 2-core EPYC measured W x^T 4.14x faster than
    F.linear at 16 rows where its next profile, timed in pairs, measured 1.25, and the MoE decode
    step it planned ran 2.55x slower than predicted (runs/moe/olmoe-4l-f32-avx2)."""
    slow(), fast()
    ratios = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        slow()
        t1 = time.perf_counter()
        fast()
        ratios.append((t1 - t0) / (time.perf_counter() - t1))
    return statistics.median(ratios)


def _int4_speeds(device: torch.device, dtype: torch.dtype, sync) -> tuple[dict[int, float], float]:
    """FLOP/s of the int4 kernel by activation rows (KERNEL_ROWS) on MATMUL_SHAPE weights packed
    as the engine packs them, and elements/s of dequantizing one (the dense copy the engine
    makes above the crossover); ({}, 0.0) where the kernel does not run on this device in
    `dtype`. Decode-sized products stream their weights, as _matmul_flops' do."""
    from flexgen_helm.compression.int4 import dequantize_packed, device_refusal, pack_int4
    from flexgen_helm.compression.quantize import quantize
    from flexgen_helm.policy.policy import Compression

    if device_refusal(dtype, device) is not None:
        return {}, 0.0
    packed = pack_int4(quantize(torch.randn(*MATMUL_SHAPE, device=device).to(dtype),
                                Compression(4, KERNEL_GROUP_SIZE, 1), 1), device)
    return _kernel_speeds(packed, lambda: dequantize_packed(packed, dtype), device, dtype, sync)


def _int8_speeds(device: torch.device, dtype: torch.dtype, sync) -> tuple[dict[int, float], float]:
    """As _int4_speeds, for 8-bit weights per output channel in the int8 kernel's layout."""
    from flexgen_helm.compression.int8 import dequantize_int8, device_refusal, pack_int8
    from flexgen_helm.compression.quantize import quantize
    from flexgen_helm.policy.policy import PER_CHANNEL, Compression

    if device_refusal(dtype, device) is not None:
        return {}, 0.0
    packed = pack_int8(quantize(torch.randn(*MATMUL_SHAPE, device=device).to(dtype), Compression(8, PER_CHANNEL), 1),
                       dtype)
    return _kernel_speeds(packed, lambda: dequantize_int8(packed, dtype), device, dtype, sync)


def _kernel_speeds(packed, dequantize, device: torch.device, dtype: torch.dtype, sync
                   ) -> tuple[dict[int, float], float]:
    """A packed MATMUL_SHAPE weight's kernel FLOP/s by KERNEL_ROWS, and elements/s of `dequantize`."""
    from flexgen_helm.compression.int4 import CompressedWeight

    out_f, in_f = MATMUL_SHAPE
    # copies of one packed weight: the bytes' values do not change the kernel's speed, only
    # that together they are larger than any CPU cache
    ws = [CompressedWeight([(0, packed.clone())], MATMUL_SHAPE, dtype, max_kernel_rows=None)
          for _ in range(STREAMED_WEIGHTS)]
    return _linear_rates(ws, KERNEL_ROWS, device, dtype, sync, None), out_f * in_f / _timed(dequantize, sync=sync)


def _attention_speeds(device: torch.device, dtype: torch.dtype, sync) -> tuple[float, float, dict[int, float]]:
    """Attention as the executor runs it (`attend`: fused, in the engine dtype), at
    OPT-1.3B-like head sizes: a prefill's FLOP/s, a decode step's cache bytes read per second
    at 512 keys on the path the engine will take, and by FUSED_DECODE_KEYS the fused kernel's
    gain over the float32 path (DeviceSpeeds.attn_decode_fused_gains; empty where the engine
    has no choice)."""
    units, s, d = 16, 512, 64
    q = torch.randn(units, 1, s, d, device=device).to(dtype)
    k = torch.randn(units, s, d, device=device).to(dtype)
    valid = torch.ones(units, s, dtype=torch.bool, device=device)
    prefill_flops = 4 * units * s * s * d / _timed(lambda: attend(q, k, k, valid, causal=True), sync=sync)

    units, t = 256, 512
    gains, step = {}, _decode_attention(device, dtype, units, 1, t, d)
    if device.type in FUSED_DECODE and dtype == torch.bfloat16:  # the steps fused_decode may send there
        for keys in FUSED_DECODE_KEYS:
            per_shape = []
            for n, r in FUSED_DECODE_UNITS:
                timed = _decode_attention(device, dtype, n, r, keys, d)
                float32_path, fused = (_on_decode_path(device, most, timed) for most in (None, 1))
                per_shape.append(paired_ratio(float32_path, fused, pairs=9))  # a few ms a pair
            gains[keys] = round(min(per_shape), 3)
        step = _on_decode_path(device, _fused_decode_from_keys(gains), step)
    cache_bytes = DECODE_CACHE_LAYERS * 2 * t * units * d * torch.finfo(dtype).bits // 8
    return prefill_flops, cache_bytes / _timed(step, sync=sync), gains


def prefix_part_fused_gains(device: torch.device, dtype: torch.dtype, calls: int = 20) -> dict[str, float]:
    """DeviceSpeeds.attn_prefix_fused_gains: our products' time over the fused kernel's, timed
    in pairs, for each use of a bf16 shared prefix's part of attention: "decode", a decode
    step's call past the prefix (attention.attend_past_shared_prefix) at SmolLM2's shapes, 32
    sequences past a 1,000-token prefix with 16 keys of their own, `calls` calls a timing (one
    takes a few hundred us); "window", a few-shot prefill window's attention
    (attention.attend_window_past_shared_prefix: 8 prompts' 85 own tokens past 300 prefix
    keys; its own part the same either way). Each path over the layout it is made for (our
    products' keys transposed, the kernel's by position). Empty where no bf16 layout is made
    (attention.prefix_for_decode)."""
    kvh, r, d, sequences, own = 3, 3, 64, 32, 16
    if device.type not in FUSED_PREFIX_PART or prefix_for_decode(
            *(torch.randn(kvh, 2, d, device=device) for _ in range(2)), device, dtype).key_mean is None:
        return {}

    def taking(use: str, fused: bool, length: int, work):
        """work(prefix) over a prefix made for `use`, which runs on the fused kernel or not."""
        uses = (use,) if fused else ()
        keys, values = (torch.randn(kvh, length, d, device=device) for _ in range(2))
        before = set_fused_prefix_part(device.type, uses)
        try:
            prefix = prefix_for_decode(keys, values, device, dtype, use=use)
        finally:
            set_fused_prefix_part(device.type, before)

        def run():
            before = set_fused_prefix_part(device.type, uses)
            try:
                work(prefix)
            finally:
                set_fused_prefix_part(device.type, before)
        return run

    units = sequences * kvh
    q = torch.randn(units, r, 1, d, device=device).to(dtype)
    k, v = (torch.randn(units, own, d, device=device).to(dtype) for _ in range(2))
    mine = torch.ones(units, own, dtype=torch.bool, device=device)

    def decode_steps(prefix):
        for _ in range(calls):
            attend_past_shared_prefix(q, k, v, mine, prefix)

    window = 85
    window_q = torch.randn(8 * kvh, r, window, d, device=device).to(dtype)
    window_k, window_v = (torch.randn(8 * kvh, window, d, device=device).to(dtype) for _ in range(2))
    window_valid = torch.ones(8 * kvh, window, dtype=torch.bool, device=device)
    window_part = functools.partial(attend_window_past_shared_prefix, window_q, window_k, window_v, window_valid)
    uses = {"decode": (1000, decode_steps), "window": (300, window_part)}
    assert tuple(uses) == PREFIX_PART_USES
    return {use: round(paired_ratio(taking(use, False, length, work), taking(use, True, length, work), pairs=9), 3)
            for use, (length, work) in uses.items()}


def _decode_attention(device: torch.device, dtype: torch.dtype, units: int, r: int, t: int, d: int):
    """A decode step's attention (r query heads a unit) over DECODE_CACHE_LAYERS layers' caches
    of t keys: memory tiers' slots, (rows, units, d), as the schedule reads them in place (the
    new position's key and value written into its row, the positions up to it attended as a
    view), a layer after another, so that no layer's cache is still in the CPU's caches when it
    is read again."""
    slots = [[torch.randn(t + 1, units, d, device=device).to(dtype) for _ in range(2)]
             for _ in range(DECODE_CACHE_LAYERS)]
    k1 = torch.randn(units, d, device=device).to(dtype)
    q1 = torch.randn(units, r, 1, d, device=device).to(dtype)
    valid = torch.ones(units, t + 1, dtype=torch.bool, device=device)
    valid[::4, :t // 8] = False  # a block's left padding (the fused kernel then takes a mask)

    def step():
        for kc, vc in slots:
            kc[t].copy_(k1)
            vc[t].copy_(k1)
            attend(q1, kc.transpose(0, 1), vc.transpose(0, 1), valid, causal=False)
    return step


def _on_decode_path(device: torch.device, from_keys: int | None, step):
    """step, with bf16 decode steps on the fused kernel from `from_keys` keys (None: never)
    while it runs, the setting put back after."""
    def on_path():
        before = set_fused_decode(device.type, from_keys)
        try:
            step()
        finally:
            set_fused_decode(device.type, before)
    return on_path


def _fused_decode_from_keys(gains: dict[int, float]) -> int | None:
    """DeviceSpeeds.fused_decode_from_keys of a gains table."""
    most = None
    for keys in sorted(gains, reverse=True):
        if gains[keys] <= FLIPPED_MIN_GAIN:
            break
        most = keys
    return most


def measure_elementwise_rate(device: torch.device, dtype: torch.dtype, sync=None) -> float:
    """Elements per second of the kinds of pass a block makes (an activation, an add, a
    copy), over a prefill's activations (1024 rows x an 8192-wide MLP: bigger than a CPU's caches)."""
    a, b = torch.randn(1024, 8192, device=device).to(dtype), torch.randn(1024, 8192, device=device).to(dtype)
    out = torch.empty_like(a)

    def elementwise():
        torch.clamp_min(a, 0, out=out)  # what relu runs
        torch.add(a, b, out=out)
        out.copy_(b)

    return 3 * a.numel() / _timed(elementwise, sync=sync)


def _bandwidth(src: torch.Tensor, dst: torch.Tensor, sync=None) -> float:
    return src.numel() * src.element_size() / _timed(lambda: dst.copy_(src, non_blocking=True), sync=sync)


def measure_disk(offload_dir: Path, nbytes: int = 256 << 20, chunk: int = 16 << 20) -> dict:
    """Read bandwidth of each way of reading (memory/disk_speed.py; "read": the engine's, the
    faster O_DIRECT way), write bandwidth and the latency of a small read, with the page
    cache bypassed."""
    from flexgen_helm.memory.direct_io import read_bytes, write_bytes
    from flexgen_helm.memory.disk_speed import measure_read_modes

    offload_dir.mkdir(parents=True, exist_ok=True)
    reads = measure_read_modes(offload_dir, nbytes, chunk)
    data = torch.randint(0, 255, (chunk,), dtype=torch.uint8).numpy()
    with tempfile.NamedTemporaryFile(dir=offload_dir, prefix="profile-", suffix=".bin") as f:
        fd = f.fileno()
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            write_bytes(fd, off, data, evict=True)  # fdatasync + drop: the disk, not the cache
        write_bw = nbytes / (time.perf_counter() - t0)
        path = Path(f.name)
        lat = []
        for i in range(64):
            t0 = time.perf_counter()
            read_bytes(path, (i * 7919 * 4096) % (nbytes - 4096), 4096, bypass_page_cache=True)
            lat.append(time.perf_counter() - t0)
    return {"read_modes": reads["read_bytes_per_s"], "device_read": reads["device_read_bytes_per_s"],
            "read": reads["engine_read_bytes_per_s"], "write": write_bw, "latency": min(lat)}


# activation rows of the linear that runs beside the disk reads, per phase
OVERLAP_ROWS = {"prefill": 1024, "decode": 4}
OVERLAP_READ = 4 << 20  # about one layer's KV cache or a slice of its weights


def measure_disk_overlap_loss(offload_dir: Path, dtype: torch.dtype, seconds: float = 0.5) -> dict[str, float]:
    """Per phase, how much of the shorter of (disk reads, linears) fails to overlap the
    longer when a copy thread reads while the compute threads multiply, as the schedule
    runs them on a CPU-only machine: each alone for about `seconds`, then both at once."""
    from flexgen_helm.memory.disk_buffer import DiskBuffer

    nbytes = 128 << 20
    folder = Path(tempfile.mkdtemp(dir=offload_dir, prefix="profile-"))
    buf = None
    try:
        buf = DiskBuffer(folder / "overlap.bin", nbytes)
        buf.write(0, torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
        os.sync()

        def reads(n: int) -> None:
            for i in range(n):
                buf.read((i * OVERLAP_READ) % (nbytes - OVERLAP_READ), (OVERLAP_READ,), torch.uint8)

        out = {}
        for phase, rows in OVERLAP_ROWS.items():
            x = torch.randn(rows, MATMUL_SHAPE[1]).to(dtype)
            ws = [torch.randn(MATMUL_SHAPE).to(dtype) for _ in range(1 if rows > MAX_STREAMED_ROWS else 8)]
            out[phase] = overlap_loss(functools.partial(_cycled_linears, x, ws), reads, seconds)
        return out
    finally:
        if buf is not None:
            buf.close()
        shutil.rmtree(folder, ignore_errors=True)


def overlap_loss(compute, reads, seconds: float) -> float:
    """How much of the shorter of compute(n) and reads(n) (each about `seconds` alone) fails to
    overlap the longer when a thread reads while this one computes: 0 all hidden, 1 none."""
    n_mm, n_rd = _count_for(compute, seconds), _count_for(reads, seconds)
    c, d = _elapsed(compute, n_mm), _elapsed(reads, n_rd)
    reader = threading.Thread(target=reads, args=(n_rd,))
    t0 = time.perf_counter()
    reader.start()
    compute(n_mm)
    reader.join()
    both = time.perf_counter() - t0
    return min(1.0, max(0.0, (both - max(c, d)) / min(c, d)))


def _elapsed(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn(n)
    return time.perf_counter() - t0


def _count_for(fn, seconds: float) -> int:
    """How many calls of fn(n) take about `seconds` (after one warm call)."""
    fn(1)
    per_call = _elapsed(fn, 2) / 2
    return max(2, round(seconds / per_call))


def measure(offload_dir: str | os.PathLike | None = None, device: str | None = None,
            dtype: str | None = None) -> HardwareProfile:
    from flexgen_helm.memory.devices import pick_devices
    from flexgen_helm.memory.host_allocator import keep_freed_host_memory
    from flexgen_helm.memory.offload_dir import usable_offload_dir
    from flexgen_helm.memory.usage import current_rss_bytes
    from flexgen_helm.planner.overhead_profile import measure_fixed_costs, measure_handoff_s

    devs = pick_devices(device, dtype)
    baseline = current_rss_bytes()
    # measure with the engine's allocator setting: without it every big output is fresh pages
    # (a 4-bit (4096, 2048) weight dequantized at 0.4-0.5 G elements/s instead of 0.9)
    keep_freed_host_memory()
    offload = usable_offload_dir(offload_dir)  # before minutes of measuring
    prof = HardwareProfile(compute_device=devs.compute.type, dtype=DTYPE_NAMES[devs.dtype])
    if devs.is_cuda:
        prof.devices = {"cpu": measure_host_attention(devs.dtype), "cuda": measure_device(devs.compute, devs.dtype)}
    else:
        prof.devices = {"cpu": measure_device(torch.device("cpu"), devs.dtype)}
    prof.compute.fixed_costs = measure_fixed_costs(devs)
    prof.compute.copy_handoff_s = measure_handoff_s(devs.compute)

    n = 128 << 20
    host = torch.empty(n, dtype=torch.uint8)
    prof.memcpy_bytes_per_s = _bandwidth(torch.ones(n, dtype=torch.uint8), host)
    if devs.is_cuda:
        sync = torch.cuda.synchronize
        gpu = torch.empty(n, dtype=torch.uint8, device=devs.compute)
        pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
        prof.h2d_pinned_bytes_per_s = _bandwidth(pinned, gpu, sync)
        prof.h2d_pageable_bytes_per_s = _bandwidth(host, gpu, sync)
        prof.d2h_pinned_bytes_per_s = _bandwidth(gpu, pinned, sync)
        prof.d2h_pageable_bytes_per_s = _bandwidth(gpu, host, sync)
        prof.gpu_mem_bytes = torch.cuda.get_device_properties(devs.compute).total_memory

    disk = measure_disk(offload)
    prof.disk_read_bytes_per_s, prof.disk_write_bytes_per_s = disk["read"], disk["write"]
    prof.disk_device_read_bytes_per_s, prof.disk_read_modes = disk["device_read"], disk["read_modes"]
    prof.disk_read_latency_s = disk["latency"]
    if not devs.is_cuda:  # on a GPU machine the GPU computes and the host's cores are free to read
        prof.disk_overlap_loss = measure_disk_overlap_loss(offload, devs.dtype)
    info = machine_info()
    prof.machine = info
    prof.cpu_mem_bytes = info["ram_bytes"]
    prof.cpu_available_bytes = _mem_available()
    prof.disk_free_bytes = shutil.disk_usage(offload).free
    prof.offload_dir = str(offload)
    prof.process_baseline_bytes = baseline
    prof.measured_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    return prof


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def describe(p: HardwareProfile) -> str:
    gib, gb = 2**30, 1e9
    lines = [f"compute: {p.compute_device} ({p.dtype}); {p.machine.get('cpu', '')}, {p.machine.get('cpu_cores')} cores"]
    for name, s in p.devices.items():
        for dt, table in s.matmul_flops.items():
            lines.append(f"  {name} linear {dt}: " + ", ".join(f"{m} rows {f / 1e9:.1f}" for m, f in table.items())
                         + " GFLOP/s")
        for fam, phases in s.fixed_costs.items():
            lines.append(f"  {name} fixed costs ({fam}): " + "; ".join(
                f"{ph} {c['per_layer_batch'] * 1e3:.2f} ms per layer and GPU batch + "
                f"{c['per_step'] * 1e3:.2f} ms per step"
                + (f" + {c['per_expert'] * 1e6:.1f} us per expert a layer's call touches" if "per_expert" in c else "")
                for ph, c in phases.items()))
        if s.copy_handoff_s:
            lines.append(f"  {name} copy-thread hand-off {s.copy_handoff_s * 1e6:.1f} us per transfer")
        if s.int4_matmul_flops:
            most = s.int4_kernel_max_rows(p.dtype)
            lines.append(f"  {name} int4 kernel ({p.dtype}, groups of {KERNEL_GROUP_SIZE}): " + ", ".join(
                f"{m} rows {f / 1e9:.1f}" for m, f in s.int4_matmul_flops.items()) + " GFLOP/s; dequantize packed "
                f"{s.int4_dequant_elems_per_s / 1e9:.2f} G elements/s; the kernel wins "
                + ("at every row count measured" if most is None else f"up to {most} rows"))
        if s.int8_matmul_flops:
            most = s.int8_kernel_max_rows(p.dtype)
            lines.append(f"  {name} int8 kernel ({p.dtype}, per output channel): " + ", ".join(
                f"{m} rows {f / 1e9:.1f}" for m, f in s.int8_matmul_flops.items()) + " GFLOP/s; dequantize packed "
                f"{s.int8_dequant_elems_per_s / 1e9:.2f} G elements/s; the kernel wins "
                + ("at every row count measured" if most is None else f"up to {most} rows"))
        for kernel, table in s.kernel_over_kept_gains.items():
            lines.append(f"  {name} {kernel} kernel over a held dense copy ({p.dtype}): " + ", ".join(
                f"{m} rows {g:.2f}x" for m, g in table.items())
                + f"; the kernel takes up to {s.kernel_over_kept_rows(kernel)} rows of a weight kept dense")
        path = ""
        if s.attn_decode_fused_gains:
            most = s.fused_decode_from_keys()
            path = (" (fused kernel over the float32 path: " + ", ".join(
                f"{keys} keys {g:.2f}x" for keys, g in s.attn_decode_fused_gains.items()) + "; bf16 steps take it "
                + ("never" if most is None else f"from {most} keys") + ")")
        if s.attn_prefix_fused_gains:
            taken = s.fused_prefix_part_uses()
            path += "; past a shared prefix, the fused kernel over our products: " + ", ".join(
                f"{use} {gain:.2f}x ({'taken' if use in taken else 'not taken'})"
                for use, gain in s.attn_prefix_fused_gains.items())
        lines.append(f"  {name} attention: prefill {s.attn_prefill_flops / 1e9:.1f} GFLOP/s, decode "
                     f"{s.attn_decode_bytes_per_s / gb:.2f} GB/s of cache{path}; dequantize "
                     f"{s.dequant_elems_per_s / 1e9:.2f} G elements/s; op latency {s.op_latency_s * 1e6:.1f} us")
    lines.append(f"memcpy {p.memcpy_bytes_per_s / gb:.2f} GB/s")
    if p.is_cuda:
        lines.append(f"host->gpu pinned {p.h2d_pinned_bytes_per_s / gb:.2f}, "
                     f"pageable {p.h2d_pageable_bytes_per_s / gb:.2f}; "
                     f"gpu->host pinned {p.d2h_pinned_bytes_per_s / gb:.2f}, "
                     f"pageable {p.d2h_pageable_bytes_per_s / gb:.2f} GB/s")
    reader = "one read at a time" if p.disk_reads_in_flight == 1 else f"{p.disk_reads_in_flight} reads in flight"
    lines.append(f"disk ({p.offload_dir}, page cache bypassed, {reader}): "
                 f"read {p.disk_read_bytes_per_s / gb:.2f} GB/s, "
                 f"write {p.disk_write_bytes_per_s / gb:.2f} GB/s, 4 KiB read {p.disk_read_latency_s * 1e3:.2f} ms")
    if p.disk_read_modes:
        lines.append(f"disk device bandwidth {p.disk_device_read_bytes_per_s / gb:.2f} GB/s (the best way of reading); "
                     "each way: " + ", ".join(f"{m} {v / gb:.2f}" for m, v in p.disk_read_modes.items()) + " GB/s")
    if p.disk_overlap_loss:
        lines.append("disk reads beside compute: " + ", ".join(
            f"{phase} {loss:.0%} of the shorter not overlapped" for phase, loss in p.disk_overlap_loss.items()))
    lines.append(f"memory: gpu {p.gpu_mem_bytes / gib:.1f} GiB, cpu {p.cpu_mem_bytes / gib:.1f} GiB "
                 f"({p.cpu_available_bytes / gib:.1f} available), disk free {p.disk_free_bytes / gib:.1f} GiB")
    if p.time_scale:
        lines.append("refit time scales: " + ", ".join(f"{k} x{v:.2f}" for k, v in sorted(p.time_scale.items())))
    return "\n".join(lines)
