"""Check a tensor store (plain or compressed) byte for byte against its manifest.

The engine checks sizes when it opens a store and checksums where it reads a tensor whole
(loading into memory); disk-tier weights are read in row ranges every step, where a pass
over the file would cost a full read. This is the full pass, on demand
(`flexgen-helm verify`). A store it finds intact that was written before stores recorded
CRC-32s gets them (weights/store.py: loads then check CRC-32, not the slower sha256)."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

from flexgen_helm.weights.convert import atomic_write, exclusive_store
from flexgen_helm.weights.registry import default_cache_dir
from flexgen_helm.weights.store import FORMAT, MANIFEST, damaged_tensors


def store_problems(root: str | os.PathLike) -> list[str]:
    """What is wrong with the store in `root`, in words; [] when every tensor file has its
    manifest's size and sha256."""
    root = Path(root)
    manifest_path = root / MANIFEST
    if not root.is_dir():
        return [f"{root}: no such directory"]
    if not manifest_path.is_file():
        return [f"{root}: no {MANIFEST}: a conversion that did not finish, or not a weight store"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as e:
        return [f"{manifest_path}: not valid JSON ({e})"]
    if manifest.get("format") != FORMAT or not manifest.get("complete"):
        return [f"{root}: format {manifest.get('format')!r}, complete={manifest.get('complete')!r}: "
                f"not a finished {FORMAT} store"]
    return [f"{root}: {problem}" for problem in damaged_tensors(root, manifest.get("tensors", {}), checksum=True)]


def record_missing_crc32s(root: str | os.PathLike) -> int:
    """Add to the manifest of a store written before CRC-32s were recorded the CRC-32 of each
    tensor whose file still matches its sha256 (both sums from one read), under the store's
    lock, so that a conversion rewriting the store meanwhile is never overwritten. How many
    it added."""
    root = Path(root)
    with exclusive_store(root):
        manifest = json.loads((root / MANIFEST).read_text())
        added = 0
        for t in manifest["tensors"].values():
            if "crc32" in t:
                continue
            sha, crc = hashlib.sha256(), 0
            with open(root / t["file"], "rb") as f:
                while chunk := f.read(64 << 20):
                    sha.update(chunk)
                    crc = zlib.crc32(chunk, crc)
            if sha.hexdigest() == t["sha256"]:
                t["crc32"] = crc
                added += 1
        if added:
            atomic_write(root / MANIFEST, json.dumps(manifest, indent=1))
    return added


def cached_stores() -> list[Path]:
    """Every store in the default cache (plain stores and their compressed companions)."""
    stores = default_cache_dir() / "stores"
    return sorted(p for p in stores.iterdir() if p.is_dir()) if stores.is_dir() else []
