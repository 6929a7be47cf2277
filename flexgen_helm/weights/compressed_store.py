"""The disk tier's weights under weight compression: a companion tensor store that holds
every weight as the engine keeps it, so offloaded weight I/O moves compressed bytes.

It is an ordinary tensor store (weights/store.py: one raw file per tensor, a manifest
written last, reads of row ranges around the page cache). A weight N that takes an int4
kernel's layout (compression/int4.py) has the parts N.packed (the kernel's packed codes)
and N.scales_zeros (the kernel's (in / group, out, 2)): a weight read whole - every weight
placement does not cut, i.e. all of them but at most the two per layer whose rows straddle
a tier edge - lands exactly as the kernel takes it, two reads and no copy. The disk rows
[start, out) of a cut weight read their scales as one read of the span those rows cover in
every group, compacted by one copy (1/9 of that segment's bytes): the kernel's layout
keeps a row range of one group apart from the next group's, and a layout that kept it
together would need that copy (a transpose) on every read instead, as format 2 did.
Another compressed weight has N.data (uint8 packed codes), N.scale and N.min; a plain
one (biases, norms) is N itself. A weight in the int8 kernel's layout (compression/int8.py)
has N.packed (int8 codes), N.scales and N.zeros, each indexed by output row. Row r of a
weight lives in row r of each part when its groups run along another dimension, in row
r // group_size when they run along the rows (placement cuts those on group boundaries),
in packed row r // 8 of CUDA's tiles, and in column r of scales_zeros.

Packed layouts belong to a device type (and the CPU's to the machine), so the directory
name carries the bits, group size, group dim, the quantization method (when not RTN) and
the layout, the manifest records the whole compression setting (method included) and the
layout of each weight, and FORMAT_VERSION changes whenever what a directory name means
does: a store written under other rules is rebuilt, not misread.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Protocol

import torch
from tqdm import tqdm

from flexgen_helm.compression import int8
from flexgen_helm.compression.grids import WeightCompression, setting_of, takes_source_codes, tensor_compression
from flexgen_helm.compression.int4 import PackedInt4, cpu_block, device_refusal, packed_rows
from flexgen_helm.compression.quantize import QuantizedTensor
from flexgen_helm.compression.stored import Stored, encode, in_layout, stored_nbytes, weight_groups, weight_layout
from flexgen_helm.errors import WeightStoreError
from flexgen_helm.memory.devices import DTYPE_NAMES
from flexgen_helm.memory.disk_space import check_free_space
from flexgen_helm.models.spec import TensorSpec
from flexgen_helm.policy.policy import CALIBRATED_METHODS, PER_CHANNEL, Compression
from flexgen_helm.weights.convert import (
    STORE_ADVICE,
    atomic_write,
    disk_errors,
    exclusive_store,
    notice,
    write_tensor_file,
)
from flexgen_helm.weights.store import (
    ELEMENT_DTYPE_NAMES,
    FORMAT,
    MANIFEST,
    TensorStore,
    damaged_tensors,
    first_problem,
)

# 2: weights group along dim 1 by default, and 4-bit ones may be stored in a kernel layout.
# 3: a packed weight's scales_zeros in the kernel's (in / group, out, 2), as it computes
#    (format 2 stored (out, in / group, 2) and transposed it after every read).
FORMAT_VERSION = 3
GROUP_PARTS = ("data", "scale", "min")
PACKED_PARTS = ("packed", "scales_zeros")
INT8_PARTS = ("packed", "scales", "zeros")


class WeightCalibration(Protocol):
    """How a calibrated method (policy.CALIBRATED_METHODS) quantizes a model's weights:
    given the reader of whole tensors and the stored dtype, every compressed weight's codes.
    `settings` (plain data: calibration text, sizes) go into the manifest, so a store made
    under other settings is rebuilt."""

    settings: dict
    timings: dict  # filled by the call (plain data: seconds of its steps), kept in the manifest for reports

    def __call__(self, read_full: Callable[[str], torch.Tensor], dtype: torch.dtype
                 ) -> dict[str, QuantizedTensor]: ...


def store_layout(dtype: torch.dtype, device: torch.device) -> str:
    """The packed layout a store for this compute device and dtype uses where it can; a CPU's
    with its block of rows where that is not 64 (int4.cpu_block: AVX2's 32), so that no store is
    read on a machine that packs otherwise."""
    if device_refusal(dtype, device):
        return "groups"
    block = cpu_block() if device.type == "cpu" else None
    return f"int4{device.type}" + (str(block) if block not in (None, 64) else "")


def compressed_store_dir(store_root: Path, cfg: Compression, layout: str) -> Path:
    """Next to the model's plain store (which names the weights and the dtype)."""
    dim = "auto" if cfg.group_dim is None else cfg.group_dim
    method = "" if cfg.method == "rtn" else f"-{cfg.method}"  # RTN keeps the names its stores had
    group = "channel" if cfg.group_size == PER_CHANNEL else cfg.group_size
    return store_root.with_name(f"{store_root.name}-q{cfg.bits}g{group}d{dim}{method}-{layout}")


class CompressedStore:
    """Row-range reads of weights as stored under a compression setting."""

    def __init__(self, root: Path, cfg: Compression):
        self.store = TensorStore(root)
        self.cfg = cfg
        # each weight's own grid: a GGUF's kept codes have theirs (compression/grids.py)
        self.compressed = {name: (tuple(m["shape"]), m["group_dim"], m.get("layout"),
                                  m.get("bits", cfg.bits), m.get("group_size", cfg.group_size))
                           for name, m in self.store.manifest["compressed"].items()}

    def read(self, name: str, rows: tuple[int, int], verify: bool = False) -> Stored:
        """Rows [start, end) of a weight: packed or quantized if compressed, else a tensor.
        `verify`: check the checksum of each part read whole (loading into memory; the disk
        tier's reads of every step are not checked, `flexgen-helm verify` checks all)."""
        try:
            return self._read(name, rows, verify)
        except WeightStoreError as e:
            if not verify:
                raise
            raise WeightStoreError(f"{e} (this is the compressed store: delete {self.store.root}, the next load "
                                   "writes it again)") from e

    def _read(self, name: str, rows: tuple[int, int], verify: bool) -> Stored:
        if name not in self.compressed:
            return self.store.read(name, rows=rows, verify=verify)
        shape, gd, layout, bits, group_size = self.compressed[name]
        start, end = rows
        if layout == int8.LAYOUT:  # every part indexed by output row
            packed, scales, zeros = (self.store.read(f"{name}.{p}", rows=rows, verify=verify) for p in INT8_PARTS)
            return int8.PackedInt8(packed, scales, zeros, (end - start, shape[1]))
        if layout is not None:
            packed = self.store.read(f"{name}.packed", rows=packed_rows(layout, rows), verify=verify)
            sz_name = f"{name}.scales_zeros"
            sz = self.store.read(sz_name, verify=verify) if rows == (0, shape[0]) else \
                self.store.read_columns(sz_name, rows)  # a cut weight's rows (module doc)
            return PackedInt4(packed, sz, (end - start, shape[1]), group_size, layout)
        g = group_size if gd == 0 else 1
        span = (start // g, math.ceil(end / g))
        data, scale, mn = (self.store.read(f"{name}.{p}", rows=span, verify=verify) for p in GROUP_PARTS)
        return QuantizedTensor(data=data, scale=scale, min=mn, shape=(end - start, *shape[1:]), dtype=scale.dtype,
                               bits=bits, group_size=group_size, group_dim=gd)


def open_compressed_store(root: Path, specs: list[TensorSpec], compression: WeightCompression, dtype: torch.dtype,
                          device: torch.device, model_config: dict, read_full: Callable[[str], torch.Tensor],
                          progress: bool = True, calibration: WeightCalibration | None = None,
                          source_codes: Callable[[str], QuantizedTensor] | None = None) -> CompressedStore:
    """The compressed store in `root`, written first (from `read_full`, through `calibration`
    for a calibrated method, or from `source_codes`, the source's own codes of a weight, for
    those a SOURCE_CODE_METHODS setting keeps) if it is missing, incomplete, or of another
    model, dtype, compression, calibration, layout or format version."""
    cfg = setting_of(compression)
    if (cfg.method in CALIBRATED_METHODS) != (calibration is not None):
        raise ValueError(f"quantization method {cfg.method} "
                         + ("needs a calibration" if calibration is None else "takes no calibration"))
    if takes_source_codes(cfg) != (source_codes is not None):
        raise ValueError(f"quantization method {cfg.method} "
                         + ("needs the source's codes" if source_codes is None else "takes no source codes"))
    header = {"format": FORMAT, "compressed_format": FORMAT_VERSION, "config": model_config,
              "dtype": DTYPE_NAMES[dtype], "layout": store_layout(dtype, device),
              # the quantization method too, and which weights keep their source's codes (as JSON reads back)
              "compression": json.loads(json.dumps(dataclasses.asdict(compression))),
              "calibration": None if calibration is None else calibration.settings}
    with exclusive_store(root):  # another job may be writing it: wait, then find it done
        _open_or_write(root, header, specs, compression, dtype, device, read_full, progress, calibration,
                       source_codes)
    return CompressedStore(root, cfg)


def _open_or_write(root: Path, header: dict, specs: list[TensorSpec], compression: WeightCompression,
                   dtype: torch.dtype, device: torch.device, read_full: Callable[[str], torch.Tensor], progress: bool,
                   calibration: WeightCalibration | None,
                   source_codes: Callable[[str], QuantizedTensor] | None) -> None:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if manifest is None or not manifest.get("complete") or any(manifest.get(k) != v for k, v in header.items()):
        if manifest is None and root.is_dir() and any(root.iterdir()):
            notice(f"{root}: no complete manifest (a compression run was interrupted); writing it again")
        _write(root, header, specs, compression, dtype, device, read_full, progress, calibration, source_codes)
    else:
        damaged = damaged_tensors(root, manifest["tensors"], checksum=False)
        if damaged:
            notice(f"{root}: {first_problem(damaged)}; writing the compressed store again")
            _write(root, header, specs, compression, dtype, device, read_full, progress, calibration,
                   source_codes)


def _write(root: Path, header: dict, specs: list[TensorSpec], compression: WeightCompression, dtype: torch.dtype,
           device: torch.device, read_full: Callable[[str], torch.Tensor], progress: bool,
           calibration: WeightCalibration | None, source_codes: Callable[[str], QuantizedTensor] | None) -> None:
    cfg = setting_of(compression)
    with disk_errors(root):
        root.mkdir(parents=True, exist_ok=True)
        (root / MANIFEST).unlink(missing_ok=True)  # incomplete from here until the new one lands
        for stale in root.glob("*.tmp"):  # left by a killed run
            stale.unlink()
    own = {s.store_name: tensor_compression(compression, s.store_name, s.shape) for s in specs}
    sizes = {s.store_name: stored_nbytes(s.shape, dtype, own[s.store_name], weight_groups(own[s.store_name], s.shape))
             for s in specs}
    # what is there now will be replaced file by file: count it as free
    reusable = sum(p.stat().st_size for p in root.iterdir() if p.is_file() and p.suffix == ".bin")
    remaining = sum(sizes.values())
    check_free_space(root, remaining - reusable, "the compressed weight store", STORE_ADVICE)
    tensors, compressed = {}, {}
    started, load_before = time.perf_counter(), os.getloadavg()
    calibrated = calibration(read_full, dtype) if calibration is not None else None
    for spec in tqdm(specs, desc=f"compress weights ({cfg.bits}-bit {cfg.method})", unit="tensor",
                     disable=not progress):
        tc = own[spec.store_name]
        gd = weight_groups(tc, spec.shape)
        layout = weight_layout(tc, spec.shape, dtype, device)
        if gd is not None and calibrated is not None:
            stored = in_layout(_calibrated(calibrated, spec, gd, dtype), layout, dtype)
        elif gd is not None and takes_source_codes(tc):
            stored = in_layout(source_codes(spec.store_name), layout, dtype)
        else:
            stored = encode(read_full(spec.store_name).to(dtype), tc, gd, layout)
        if gd is None:
            tensors[spec.store_name] = write_tensor_file(root, spec.store_name, stored, header["dtype"], remaining)
        else:
            compressed[spec.store_name] = {"shape": list(spec.shape), "group_dim": gd, "layout": layout,
                                           "bits": tc.bits, "group_size": tc.group_size}
            for part_name, part in _parts(stored):
                name = f"{spec.store_name}.{part_name}"
                tensors[name] = write_tensor_file(root, name, part, ELEMENT_DTYPE_NAMES[part.dtype], remaining)
        remaining -= sizes[spec.store_name]
    # the conversion's wall time (reading the source included) and how busy the machine was, for reports
    manifest = {**header, "complete": True, "convert_s": time.perf_counter() - started,
                "convert_load_average": {"before": load_before, "after": os.getloadavg()},
                "calibration_timings": None if calibration is None else calibration.timings,
                "tensors": tensors, "compressed": compressed}
    with disk_errors(root):
        atomic_write(root / MANIFEST, json.dumps(manifest, indent=1))


def _calibrated(calibrated: dict[str, QuantizedTensor], spec: TensorSpec, group_dim: int,
                dtype: torch.dtype) -> QuantizedTensor:
    """The calibration's codes of a compressed weight, checked against what the store expects."""
    q = calibrated.get(spec.store_name)
    if q is None:
        raise ValueError(f"the calibration quantized no {spec.store_name} (a compressed weight)")
    if (tuple(q.shape), q.group_dim, q.dtype) != (tuple(spec.shape), group_dim, dtype):
        raise ValueError(f"the calibration's {spec.store_name} is {tuple(q.shape)}, groups along dim {q.group_dim}, "
                         f"{q.dtype}; the store takes {tuple(spec.shape)}, dim {group_dim}, {dtype}")
    return q


def _parts(stored: QuantizedTensor | PackedInt4 | int8.PackedInt8) -> list[tuple[str, torch.Tensor]]:
    if isinstance(stored, PackedInt4):
        return [("packed", stored.packed), ("scales_zeros", stored.scales_zeros)]
    if isinstance(stored, int8.PackedInt8):
        return list(zip(INT8_PARTS, stored.parts))
    return list(zip(GROUP_PARTS, stored.parts))
