"""Where each weight tensor lives (its home), and loading a layer's weights onto the
compute device for one use.

Under weight compression a home's parts on the gpu and cpu tiers are QuantizedTensor row
ranges of the tensor quantized once at load, and its disk parts are read from the
compressed store (weights/compressed_store.py): every tier holds compressed bytes, and a
layer is dequantized on the compute device as it is loaded for use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from flexgen_helm.compression.stored import Stored, dense, encode, stored_nbytes, weight_groups
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.placement import Segment
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.models.spec import LayerSpec, TensorSpec, all_store_tensors
from flexgen_helm.policy.policy import Compression


@dataclass
class WeightHome:
    spec: TensorSpec
    segments: list[Segment]
    data: list[Stored | None] = field(default_factory=list)  # None: read from the store on use
    compression: Compression | None = None

    @property
    def group_dim(self) -> int | None:
        return weight_groups(self.compression, self.spec.shape)


def segment_nbytes(spec: TensorSpec, segment: Segment, compression: Compression | None, dtype: torch.dtype) -> int:
    """Bytes a segment of a weight takes on its tier, compressed or not. Placement cuts
    compressed rows on group boundaries, so a segment quantized alone weighs the same."""
    shape = (segment.rows, *spec.shape[1:])
    return stored_nbytes(shape, dtype, compression, weight_groups(compression, spec.shape))


def build_homes(layers: list[LayerSpec], placement: dict[str, list[Segment]], devices: Devices,
                read_full: Callable[[str], torch.Tensor], usage: TierUsage, pin: bool,
                compression: Compression | None = None, progress: bool = False) -> dict[str, WeightHome]:
    """Fill the gpu and cpu tiers from `read_full(store_name)`; disk segments stay in the store."""
    homes: dict[str, WeightHome] = {}
    specs = all_store_tensors(layers)
    for spec in tqdm(specs, desc="placing weights", unit="tensor", disable=not progress):
        home = WeightHome(spec, placement[spec.store_name], compression=compression)
        full = None
        if any(s.tier != "disk" for s in home.segments):
            full = encode(read_full(spec.store_name).to(devices.dtype), compression, home.group_dim)
        for s in home.segments:
            if s.tier == "disk":
                home.data.append(None)
                continue
            part = full.narrow(0, s.start, s.rows)
            if s.tier == "gpu" and devices.is_cuda:
                part = part.to(devices.compute)
            elif s.tier == "cpu" and pin and devices.is_cuda:
                part = part.pin_memory()
            elif len(home.segments) > 1:
                part = part.clone()  # a view would keep the whole tensor (other tiers' rows too) alive
            usage.add(s.tier, part.nbytes)
            home.data.append(part)
        homes[spec.store_name] = home
    return homes


def load_home(home: WeightHome, devices: Devices, store) -> torch.Tensor:
    """The whole tensor on the compute device, in the compute dtype.

    A plain tensor whose home is one tier of the compute device's memory is used in place;
    otherwise its parts are copied to the compute device (the weight I/O, compressed bytes
    when compressed) and dequantized there."""
    parts = [p if p is not None else store.read(home.spec.store_name, rows=(s.start, s.end))
             for s, p in zip(home.segments, home.data)]
    if len(parts) == 1:
        return dense(parts[0].to(devices.compute, non_blocking=True), devices.dtype)
    out = torch.empty(home.spec.shape, dtype=devices.dtype, device=devices.compute)
    for s, part in zip(home.segments, parts):
        if home.group_dim is not None:
            part = dense(part.to(devices.compute, non_blocking=True), devices.dtype)
        out[s.start:s.end].copy_(part, non_blocking=True)
    return out


def load_layer(layer: LayerSpec, homes: dict[str, WeightHome], devices: Devices, store) -> dict[str, torch.Tensor]:
    return {t.key: load_home(homes[t.store_name], devices, store) for t in layer.tensors}


def home_bytes(homes: dict[str, WeightHome], dtype: torch.dtype) -> dict[str, int]:
    """Bytes of weights on each tier, as placed (compressed bytes when compressed)."""
    out = {"gpu": 0, "cpu": 0, "disk": 0}
    for h in homes.values():
        for s in h.segments:
            out[s.tier] += segment_nbytes(h.spec, s, h.compression, dtype)
    return out
