"""Where each weight tensor lives (its home), and loading a layer's weights onto the
compute device for one use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.placement import Segment
from flexgen_helm.memory.usage import TierUsage, tensor_bytes
from flexgen_helm.models.spec import LayerSpec, TensorSpec
from flexgen_helm.weights.store import TensorStore


@dataclass
class WeightHome:
    spec: TensorSpec
    segments: list[Segment]
    data: list[torch.Tensor | None] = field(default_factory=list)  # None: read from the store on use

    @property
    def single_tier(self) -> str | None:
        return self.segments[0].tier if len(self.segments) == 1 else None


def build_homes(layers: list[LayerSpec], placement: dict[str, list[Segment]], devices: Devices,
                read_full: Callable[[str], torch.Tensor], usage: TierUsage, pin: bool,
                progress: bool = False) -> dict[str, WeightHome]:
    """Fill the gpu and cpu tiers from `read_full(store_name)`; disk segments stay in the store."""
    homes: dict[str, WeightHome] = {}
    specs = [t for layer in layers for t in layer.owned()]
    for spec in tqdm(specs, desc="placing weights", unit="tensor", disable=not progress):
        segments = placement[spec.store_name]
        full = read_full(spec.store_name) if any(s.tier != "disk" for s in segments) else None
        data = []
        for s in segments:
            if s.tier == "disk":
                data.append(None)
                continue
            part = full[s.start:s.end].to(devices.dtype)
            if s.tier == "gpu":
                part = part.to(devices.compute)
            elif pin and devices.is_cuda:
                part = part.pin_memory()
            if part.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() and len(segments) > 1:
                part = part.clone()  # a slice would keep the whole tensor alive
            usage.add(s.tier, tensor_bytes(part))
            data.append(part)
        homes[spec.store_name] = WeightHome(spec, segments, data)
    return homes


def load_home(home: WeightHome, devices: Devices, store: TensorStore | None) -> torch.Tensor:
    """The whole tensor on the compute device, in the compute dtype.

    A tensor whose home is one tier of the compute device's memory is used in place;
    otherwise its segments are copied into one buffer (this is the weight I/O)."""
    tier = home.single_tier
    if tier is not None and devices.tier_device(tier) == devices.compute and home.data[0] is not None:
        return home.data[0]
    if tier == "disk" and not devices.is_cuda:
        return _read_disk(home, home.segments[0], store, devices.dtype)
    out = torch.empty(home.spec.shape, dtype=devices.dtype, device=devices.compute)
    for s, part in zip(home.segments, home.data):
        src = part if part is not None else _read_disk(home, s, store, devices.dtype)
        out[s.start:s.end].copy_(src, non_blocking=True)
    return out


def _read_disk(home: WeightHome, s: Segment, store: TensorStore, dtype: torch.dtype) -> torch.Tensor:
    return store.read(home.spec.store_name, rows=(s.start, s.end)).to(dtype)


def load_layer(layer: LayerSpec, homes: dict[str, WeightHome], devices: Devices,
               store: TensorStore | None) -> dict[str, torch.Tensor]:
    return {t.key: load_home(homes[t.store_name], devices, store) for t in layer.tensors}


def home_bytes(homes: dict[str, WeightHome], dtype_bytes: int) -> dict[str, int]:
    """Bytes of weights on each tier, as placed."""
    out = {"gpu": 0, "cpu": 0, "disk": 0}
    for h in homes.values():
        for s in h.segments:
            out[s.tier] += s.rows * h.spec.row_numel * dtype_bytes
    return out
