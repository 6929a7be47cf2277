"""Convert any WeightSource into the engine's tensor store (see weights/store.py).

One tensor is in memory at a time, so peak RAM is about the largest tensor. Every file
is written under a temporary name and renamed into place, and manifest.json, which
marks a store complete, is written last: an interrupted conversion never looks finished.
A journal of finished tensors lets the next run skip them (after checking their
checksums) instead of reading the source again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import sys
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from flexgen_helm.errors import FlexGenError, OffloadDirError
from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.memory.disk_space import FULL_ERRNOS, check_free_space, disk_full
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.weights.source import WeightSource
from flexgen_helm.weights.store import (
    FORMAT,
    MANIFEST,
    damaged_tensors,
    first_problem,
    tensor_file_name,
    tensor_file_problem,
)

JOURNAL = ".convert-journal.jsonl"
_CHUNK = 64 << 20


def config_to_json(cfg: ModelConfig) -> dict:
    """The config as it appears in a manifest (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_from_json(d: dict) -> ModelConfig:
    """Inverse of config_to_json, e.g. for TensorStore(...).config."""
    def pair(key, value):  # LongRoPE's factors are lists in JSON, tuples in the config
        return key, tuple(value) if isinstance(value, list) else value
    return ModelConfig(**{**d, "rope_scaling": tuple(pair(*p) for p in d.get("rope_scaling", ())),
                          "sliding_windows": tuple(d.get("sliding_windows", ())),
                          "dense_blocks": tuple(d.get("dense_blocks", ()))})


def convert(source: WeightSource, out_dir: str | os.PathLike, dtype: str = "float16",
            progress: bool = True, verify: bool = False) -> Path:
    """Write `source` as a tensor store in `out_dir` and return the directory.

    A complete store of the same config and dtype whose files have their manifest's sizes
    (and, with `verify`, checksums) is reused as is; otherwise, and after an interruption,
    the tensors whose checksums match are kept and the others written again. Processes that share a cache (pipeline
    stages, HELM workers) convert one at a time; the others then find the store done.
    """
    with exclusive_store(Path(out_dir)):
        return _convert(source, out_dir, dtype, progress, verify)


@contextlib.contextmanager
def exclusive_store(out: Path):
    """Held while a process checks and writes the store `out`: processes sharing a cache
    (pipeline stages, HELM workers, Slurm jobs on one shared filesystem) take turns, so
    that none deletes another's files half written; the lock file sits beside `out`."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.parent / f".{out.name}.lock", "w")
    except OSError as e:
        raise OffloadDirError(f"{out}: cannot write the weight store there ({e}); choose a writable directory") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _convert(source: WeightSource, out_dir: str | os.PathLike, dtype: str, progress: bool, verify: bool) -> Path:
    if dtype not in DTYPES:
        raise FlexGenError(f"unsupported store dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    out = Path(out_dir)
    header = {"format": FORMAT, "config": config_to_json(source.config), "dtype": dtype}
    specs = source.tensor_specs()
    nbytes = {s.store_name: s.numel * DTYPES[dtype].itemsize for s in specs}

    previous = _load_json(out / MANIFEST)
    if previous is not None and _same_model(previous, header) and previous.get("complete"):
        damaged = damaged_tensors(out, previous.get("tensors", {}), verify, nbytes, dtype)
        if not damaged and set(previous.get("tensors", {})) == set(nbytes):
            return out
        notice(f"{out}: {first_problem(damaged) if damaged else 'tensors missing from the manifest'}; "
               "rebuilding what is damaged")
    elif previous is not None and previous.get("complete"):
        raise OffloadDirError(
            f"{out} already holds a converted store of another model or dtype "
            f"({previous.get('config', {}).get('name')}, {previous.get('dtype')}); "
            "choose another directory or delete it"
        )
    candidates = {**(previous or {}).get("tensors", {}), **_journal_entries(out / JOURNAL, header)}
    if previous is None and out.is_dir() and any(out.iterdir()):
        notice(f"{out}: no complete manifest (a conversion was interrupted); finishing it, keeping the tensors "
               "whose checksums match")

    with disk_errors(out):
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("*.tmp"):  # left by a killed run
            stale.unlink()
        (out / MANIFEST).unlink(missing_ok=True)  # incomplete from here until the new one lands
    entries = {name: e for name, e in candidates.items()
               if name in nbytes and tensor_file_problem(out, e, nbytes[name], dtype, checksum=True) is None}
    todo = [s.store_name for s in specs if s.store_name not in entries]
    check_free_space(out, sum(nbytes[n] for n in todo), "the weight store", STORE_ADVICE)

    with disk_errors(out):
        lines = [header, *({n: e} for n, e in entries.items())]
        atomic_write(out / JOURNAL, "".join(json.dumps(x) + "\n" for x in lines))
        journal = open(out / JOURNAL, "a")
    with journal, tqdm(total=sum(nbytes.values()), initial=sum(nbytes[n] for n in entries), unit="B",
                       unit_scale=True, unit_divisor=1024, desc=f"convert {source.config.name}",
                       disable=not progress) as bar:
        remaining = sum(nbytes[n] for n in todo)
        for name, t in source.iter_tensors(todo):
            entries[name] = write_tensor_file(out, name, t.to(DTYPES[dtype]), dtype, remaining)
            del t  # else the next read would overlap this tensor and double peak RAM
            remaining -= nbytes[name]
            with disk_errors(out):
                journal.write(json.dumps({name: entries[name]}) + "\n")
                journal.flush()
            bar.update(nbytes[name])

    manifest = {**header, "complete": True, "tensors": {s.store_name: entries[s.store_name] for s in specs}}
    with disk_errors(out):
        atomic_write(out / MANIFEST, json.dumps(manifest, indent=1))
        (out / JOURNAL).unlink(missing_ok=True)
    return out


def _same_model(manifest: dict, header: dict) -> bool:
    return all(manifest.get(k) == v for k, v in header.items())


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _journal_entries(path: Path, header: dict) -> dict:
    """Tensors a previous run of the same conversion finished; a torn last line is ignored."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    if not records or records[0] != header:
        return {}
    return {k: v for r in records[1:] for k, v in r.items()}


def notice(message: str) -> None:
    """What a user should know about a store (found damaged, being rebuilt): on stderr."""
    print(f"flexgen-helm: {message}", file=sys.stderr, flush=True)


STORE_ADVICE = "free some space or convert into another directory"


@contextlib.contextmanager
def disk_errors(out: Path, need: int = 0):
    """Turn an OSError from writing into an OffloadDirError that says what to do."""
    try:
        yield
    except OSError as e:
        if e.errno in FULL_ERRNOS:
            raise disk_full(out, need, "the weight store (still to write)", STORE_ADVICE) from e
        raise OffloadDirError(f"{out}: cannot write the weight store there ({e}); choose a writable directory") from e


def write_tensor_file(out: Path, name: str, t: torch.Tensor, dtype: str, remaining: int) -> dict:
    """Write one tensor atomically, hashing as it goes; return its manifest entry: sha256 for
    `flexgen-helm verify`, CRC-32 for the check at every load (weights/store.py)."""
    file = tensor_file_name(name)
    data = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
    tmp = out / (file + ".tmp")
    h, crc = hashlib.sha256(), 0
    try:
        with disk_errors(out, remaining), open(tmp, "wb") as f:
            for start in range(0, len(data), _CHUNK):
                chunk = data[start:start + _CHUNK]
                h.update(chunk)
                crc = zlib.crc32(chunk, crc)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        with disk_errors(out, remaining):
            os.replace(tmp, out / file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"file": file, "shape": list(t.shape), "dtype": dtype, "nbytes": len(data), "sha256": h.hexdigest(),
            "crc32": crc}


def atomic_write(path: Path, text: str) -> None:
    """`path` holds the old text or the new one, never a part: even after a crash of the
    machine (the new text reaches the disk before the rename)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
