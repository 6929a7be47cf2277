"""The disk tier's weights under weight compression: a companion tensor store that holds
every weight as the engine keeps it, so offloaded weight I/O moves compressed bytes.

It is an ordinary tensor store (weights/store.py: one raw file per tensor, a manifest
written last, reads of row ranges around the page cache) whose tensors are, for each
compressed weight N, its parts N.data (uint8 packed codes), N.scale and N.min, and for
each plain weight (biases, norms) N itself. Row r of a weight lives in row r of each part
when its groups run along another dimension, and in row r // group_size when they run
along the rows (placement cuts those on group boundaries). The directory name carries the
bits, group size and group dim, so each compression setting is written once and reused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from flexgen_helm.compression.quantize import QuantizedTensor
from flexgen_helm.compression.stored import Stored, encode, weight_groups
from flexgen_helm.models.spec import TensorSpec
from flexgen_helm.policy.policy import Compression
from flexgen_helm.weights.convert import atomic_write, disk_errors, write_tensor_file
from flexgen_helm.weights.store import DTYPE_NAMES, FORMAT, MANIFEST, TensorStore

PARTS = ("data", "scale", "min")


def compressed_store_dir(store_root: Path, cfg: Compression) -> Path:
    """Next to the model's plain store (which names the weights and the dtype)."""
    dim = "auto" if cfg.group_dim is None else cfg.group_dim
    return store_root.with_name(f"{store_root.name}-q{cfg.bits}g{cfg.group_size}d{dim}")


class CompressedStore:
    """Row-range reads of weights as stored under a compression setting."""

    def __init__(self, root: Path, cfg: Compression):
        self.store = TensorStore(root)
        self.cfg = cfg
        self.compressed = {name: (tuple(m["shape"]), m["group_dim"])
                           for name, m in self.store.manifest["compressed"].items()}

    def read(self, name: str, rows: tuple[int, int]) -> Stored:
        """Rows [start, end) of a weight: a QuantizedTensor if compressed, else a tensor."""
        if name not in self.compressed:
            return self.store.read(name, rows=rows)
        shape, gd = self.compressed[name]
        start, end = rows
        g = self.cfg.group_size if gd == 0 else 1
        span = (start // g, math.ceil(end / g))
        data, scale, mn = (self.store.read(f"{name}.{p}", rows=span) for p in PARTS)
        return QuantizedTensor(data=data, scale=scale, min=mn, shape=(end - start, *shape[1:]), dtype=scale.dtype,
                               bits=self.cfg.bits, group_size=self.cfg.group_size, group_dim=gd)


def open_compressed_store(root: Path, specs: list[TensorSpec], cfg: Compression, dtype: torch.dtype,
                          model_config: dict, read_full: Callable[[str], torch.Tensor],
                          progress: bool = True) -> CompressedStore:
    """The compressed store in `root`, written first (from `read_full`) if it is missing,
    incomplete, or of another model, dtype or compression."""
    header = {"format": FORMAT, "config": model_config, "dtype": DTYPE_NAMES[dtype],
              "compression": {"bits": cfg.bits, "group_size": cfg.group_size, "group_dim": cfg.group_dim}}
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if manifest is None or not manifest.get("complete") or any(manifest.get(k) != v for k, v in header.items()):
        _write(root, header, specs, cfg, dtype, read_full, progress)
    return CompressedStore(root, cfg)


def _write(root: Path, header: dict, specs: list[TensorSpec], cfg: Compression, dtype: torch.dtype,
           read_full: Callable[[str], torch.Tensor], progress: bool) -> None:
    with disk_errors(root):
        root.mkdir(parents=True, exist_ok=True)
        (root / MANIFEST).unlink(missing_ok=True)  # incomplete from here until the new one lands
    tensors, compressed = {}, {}
    for spec in tqdm(specs, desc=f"compress weights ({cfg.bits}-bit)", unit="tensor", disable=not progress):
        gd = weight_groups(cfg, spec.shape)
        stored = encode(read_full(spec.store_name).to(dtype), cfg, gd)
        if gd is None:
            tensors[spec.store_name] = write_tensor_file(root, spec.store_name, stored, header["dtype"], 0)
            continue
        compressed[spec.store_name] = {"shape": list(spec.shape), "group_dim": gd}
        for part_name, part in zip(PARTS, stored.parts):
            name = f"{spec.store_name}.{part_name}"
            tensors[name] = write_tensor_file(root, name, part, DTYPE_NAMES.get(part.dtype, "uint8"), 0)
    manifest = {**header, "complete": True, "tensors": tensors, "compressed": compressed}
    with disk_errors(root):
        atomic_write(root / MANIFEST, json.dumps(manifest, indent=1))
