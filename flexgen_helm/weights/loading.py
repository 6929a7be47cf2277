"""From a resolved model to the weights the engine places: a converted store (needed for
real weights and for anything on the disk tier) or, for dummy weights that stay in
memory, tensors made on the fly."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from flexgen_helm.models.registry import ResolvedModel, resolve, store_dir_for
from flexgen_helm.weights.convert import convert
from flexgen_helm.weights.dummy import DummyWeights
from flexgen_helm.weights.store import DTYPE_NAMES, TensorStore


def open_weights(resolved: ResolvedModel, dtype: torch.dtype, offload_dir: Path, needs_disk: bool,
                 progress: bool) -> tuple[TensorStore | None, Callable[[str], torch.Tensor]]:
    dtype_name = DTYPE_NAMES[dtype]
    dummy = isinstance(resolved.source, DummyWeights)
    if dummy and not needs_disk:
        return None, lambda name: resolved.source.read(name).to(dtype)
    # Dummy weights for the disk tier are written next to the other offloaded tensors.
    root = store_dir_for(resolved, dtype_name, cache_dir=offload_dir if dummy else None)
    store = TensorStore(convert(resolved.source, root, dtype_name, progress=progress))
    return store, lambda name: store.read(name, verify=True)


def convert_named(model: str, path: str | None, dummy: bool, dtype: str, out_dir: str | None,
                  verify: bool) -> Path:
    resolved = resolve(model, path=path, dummy=dummy)
    root = convert(resolved.source, out_dir or store_dir_for(resolved, dtype), dtype)
    TensorStore(root, verify="full" if verify else "size")
    return root
