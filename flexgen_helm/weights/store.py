"""The engine's on-disk weight store: one raw file per tensor plus a manifest.

The disk tier reads weights straight from these files, row ranges at a time, with the
OS page cache bypassed (O_DIRECT where the file system allows, else posix_fadvise).

Each tensor's manifest entry has its sha256 and (stores written since 2026-11-27) its CRC-32.
A whole-tensor read for the memory tiers checks the CRC-32 at every load: it finds the
corruption a disk or a partial copy causes, at 2.2 GB/s where sha256 runs at 0.26 GB/s on a
CPU without SHA instructions (runs/bench/store_checksum: SmolLM2's float32 store read and
checked in 0.8 s instead of 2.6 s). `flexgen-helm verify` checks sha256, and records the CRC-32s
of an intact store written before them; until then such a store is checked by sha256 at load.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from flexgen_helm.errors import WeightStoreError
from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.memory.direct_io import read_bytes

FORMAT = "flexgen-helm-store/1"
MANIFEST = "manifest.json"

# Element types a stored tensor may have: the model dtypes, and uint8 / int32 / int8 for the
# packed codes of compressed weights (weights/compressed_store.py; int32: CUDA's int4 tiles;
# int8: the int8 kernel's codes).
ELEMENT_DTYPES = {**DTYPES, "uint8": torch.uint8, "int32": torch.int32, "int8": torch.int8}
ELEMENT_DTYPE_NAMES = {v: k for k, v in ELEMENT_DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    sha256: str
    crc32: int | None  # None in stores written before CRC-32s were recorded

    @property
    def torch_dtype(self) -> torch.dtype:
        return ELEMENT_DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape[0] else 0


def tensor_file_name(name: str) -> str:
    return name.replace("/", "_") + ".bin"


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _intact(t: StoredTensor, data: bytes | memoryview) -> bool:
    """Whether a whole tensor's bytes are the ones written: its CRC-32 where recorded (fast),
    else its sha256."""
    if t.crc32 is not None:
        return zlib.crc32(data) == t.crc32
    return sha256_of(data) == t.sha256


def tensor_file_problem(out: Path, entry: dict, nbytes: int | None, dtype: str | None, checksum: bool) -> str | None:
    """None if the tensor's file matches its manifest entry (size; and sha256 if `checksum`),
    else what is wrong with it."""
    path = out / entry["file"]
    if (dtype is not None and entry.get("dtype") != dtype) or (nbytes is not None and entry.get("nbytes") != nbytes):
        return "recorded with another dtype or size than the model has"
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != entry["nbytes"]:
        return f"{path.name} is {size} bytes, the manifest says {entry['nbytes']} (truncated or overwritten)"
    if checksum:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(64 << 20):
                h.update(chunk)
        if h.hexdigest() != entry.get("sha256"):
            return f"{path.name} does not match its sha256 (corrupt)"
    return None


def damaged_tensors(root: Path, tensors: dict, checksum: bool, nbytes: dict | None = None,
                    dtype: str | None = None) -> list[str]:
    """What is wrong with each of a manifest's `tensors` in `root`, in words ("tensor NAME:
    ..."); `nbytes` and `dtype`: what the model says each should be, where known."""
    problems = []
    for name, entry in tensors.items():
        problem = tensor_file_problem(root, entry, None if nbytes is None else nbytes.get(name), dtype, checksum)
        if problem:
            problems.append(f"tensor {name}: {problem}")
    return problems


def first_problem(problems: list[str]) -> str:
    """The first of `problems`, and how many more there are."""
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


class TensorStore:
    """Read access to a complete store directory."""

    def __init__(self, root: str | os.PathLike, verify: str = "size"):
        self.root = Path(root)
        manifest_path = self.root / MANIFEST
        if not manifest_path.exists():
            raise WeightStoreError(
                f"{self.root}: no {MANIFEST}; this is not a flexgen-helm weight store, or its conversion did not "
                f"finish (run `flexgen-helm convert` again)"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise WeightStoreError(
                f"{manifest_path}: corrupt manifest ({e}); delete the store and convert again") from e
        if manifest.get("format") != FORMAT or not manifest.get("complete"):
            raise WeightStoreError(
                f"{self.root}: incomplete or foreign store (format {manifest.get('format')!r}); convert again")
        self.manifest = manifest
        self.config = manifest["config"]
        self.tensors = {
            name: StoredTensor(name=name, file=t["file"], shape=tuple(t["shape"]), dtype=t["dtype"],
                               nbytes=t["nbytes"], sha256=t["sha256"], crc32=t.get("crc32"))
            for name, t in manifest["tensors"].items()
        }
        if verify in ("size", "full"):
            self.check_sizes()
        if verify == "full":
            for name in self.tensors:
                self.read(name, verify=True)

    def path(self, name: str) -> Path:
        return self.root / self.tensors[name].file

    def info(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightStoreError(f"{self.root}: tensor {name!r} is missing from the store") from None

    def check_sizes(self) -> None:
        damaged = damaged_tensors(self.root, self.manifest["tensors"], checksum=False)
        if damaged:
            raise WeightStoreError(f"{self.root}: {first_problem(damaged)}; convert the model again")

    def read(self, name: str, rows: tuple[int, int] | None = None, verify: bool = False,
             bypass_page_cache: bool = True) -> torch.Tensor:
        """Rows [start, end) of a tensor (all of it by default), as a CPU tensor."""
        t = self.info(name)
        start, end = rows if rows is not None else (0, t.shape[0])
        data = read_bytes(self.root / t.file, start * t.row_bytes, (end - start) * t.row_bytes, bypass_page_cache)
        if verify and (start, end) == (0, t.shape[0]) and not _intact(t, data):
            raise WeightStoreError(
                f"{self.root / t.file}: checksum mismatch for tensor {t.name}: the file is corrupt; "
                "convert the model again"
            )
        out = torch.frombuffer(data, dtype=t.torch_dtype) if len(data) else torch.empty(0, dtype=t.torch_dtype)
        return out.view(end - start, *t.shape[1:])

    def read_columns(self, name: str, columns: tuple[int, int]) -> torch.Tensor:
        """Entries [start, end) of dim 1 in every row of a tensor, contiguous: one read of the
        bytes they span (the rows' other entries in between too), then one copy that drops
        those. For a weight's part stored with its output rows along dim 1 (weights/
        compressed_store.py), when only some of the rows are wanted."""
        t = self.info(name)
        start, end = columns
        if (start, end) == (0, t.shape[1]):
            return self.read(name)
        inner = t.row_bytes // t.shape[1]  # bytes of one entry of dim 1
        span = (t.shape[0] - 1) * t.row_bytes + (end - start) * inner
        data = read_bytes(self.root / t.file, start * inner, span)
        strides = torch.empty(t.shape, device="meta").stride()  # the whole tensor's, contiguous
        wanted = torch.frombuffer(data, dtype=t.torch_dtype).as_strided((t.shape[0], end - start, *t.shape[2:]),
                                                                        strides)
        return wanted.contiguous()

    def lacks_crc32s(self) -> bool:
        """Whether whole-tensor reads check sha256 (a store written before CRC-32s were recorded)."""
        return any(t.crc32 is None for t in self.tensors.values())

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
