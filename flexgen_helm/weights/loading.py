"""From a resolved model to the weights the engine places: a converted store (needed for
real weights and for anything on the disk tier) or, for dummy weights that stay in
memory, tensors made on the fly. Under weight compression the disk tier reads a
compressed companion store instead (weights/compressed_store.py); so do all tiers under a
method quantized once at conversion (compression.stored.quantized_once), whose store is
written even when nothing is on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from flexgen_helm.compression.grids import WeightCompression, setting_of, takes_source_codes
from flexgen_helm.compression.stored import quantized_once
from flexgen_helm.memory.devices import DTYPE_NAMES
from flexgen_helm.models import family_of
from flexgen_helm.models.spec import all_store_tensors
from flexgen_helm.weights.compressed_store import (
    CompressedStore,
    WeightCalibration,
    compressed_store_dir,
    open_compressed_store,
    store_layout,
)
from flexgen_helm.weights.convert import config_to_json, convert, notice
from flexgen_helm.weights.dummy import DummyWeights
from flexgen_helm.weights.registry import ResolvedModel, resolve, store_dir_for
from flexgen_helm.weights.source_grids import weight_grids
from flexgen_helm.weights.store import TensorStore

_TOLD_LACKS_CRC32S: set = set()  # stores whose sha256 loads were pointed out (once a process)


def open_weights(resolved: ResolvedModel, dtype: torch.dtype, offload_dir: Path, needs_disk: bool,
                 progress: bool, compression: WeightCompression, device: torch.device,
                 calibration: WeightCalibration | None = None
                 ) -> tuple[TensorStore | CompressedStore | None, Callable[[str], torch.Tensor]]:
    """The store the disk tier reads (None when nothing is on disk and no store is needed)
    and a reader of whole tensors in `dtype` for the memory tiers. `device` computes: the
    compressed store packs weights for its int4 kernel. When a compressed store is open,
    the memory tiers take their compressed weights from it too (memory.weight_homes).
    `calibration`: how a calibrated method (gptq) quantizes, should its store be written."""
    dtype_name = DTYPE_NAMES[dtype]
    dummy = isinstance(resolved.source, DummyWeights)
    # Dummy weights for the disk tier are written next to the other offloaded tensors.
    root = store_dir_for(resolved, dtype_name, cache_dir=offload_dir if dummy else None)
    if dummy and not (needs_disk and compression is None):
        store, read_full = None, lambda name: resolved.source.read(name).to(dtype)
    else:
        plain = TensorStore(convert(resolved.source, root, dtype_name, progress=progress))
        if plain.lacks_crc32s() and plain.root not in _TOLD_LACKS_CRC32S:
            _TOLD_LACKS_CRC32S.add(plain.root)
            notice(f"{plain.root} was written before stores recorded CRC-32s, so loading it checks each tensor's "
                   "sha256 (slower); `flexgen-helm verify` records them in every cached store that is intact")
        store, read_full = plain, lambda name: plain.read(name, verify=True)
    # the store also holds what a costly method computed once, for every tier to load
    if compression is not None and (needs_disk or quantized_once(compression)):
        specs = all_store_tensors(family_of(resolved.config).layer_specs(resolved.config))
        compression = weight_grids(compression, resolved.source, specs)  # as the engine resolved it, or now
        source_codes = resolved.source.read_codes if takes_source_codes(setting_of(compression)) else None
        store = open_compressed_store(compressed_store_dir(root, setting_of(compression), store_layout(dtype, device)),
                                      specs, compression, dtype, device, config_to_json(resolved.config), read_full,
                                      progress, calibration, source_codes)
    if store is not None:  # the memory tiers read the store from now on
        resolved.source.release()
    return store, read_full


def convert_named(model: str, path: str | None, dummy: bool, dtype: str, out_dir: str | None,
                  verify: bool) -> Path:
    resolved = resolve(model, path=path, dummy=dummy)
    root = convert(resolved.source, out_dir or store_dir_for(resolved, dtype), dtype, verify=verify)
    TensorStore(root, verify="full" if verify else "size")
    return root
