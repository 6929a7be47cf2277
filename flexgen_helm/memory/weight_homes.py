"""Where each weight tensor lives (its home), and loading a layer's weights onto the
compute device for one use.

Under weight compression a home's parts on the gpu and cpu tiers are row ranges of the
tensor quantized once at load, or read whole (checksums checked) from the compressed store
when one is open - packed for the compute device's int4 kernel where the settings allow
(compression/int4.py), else QuantizedTensors - and its disk parts are read
from the compressed store (weights/compressed_store.py) in the same form: every tier holds
compressed bytes, and a loaded layer hands the models a CompressedWeight, which multiplies
on the packed bytes or dequantizes on the compute device as the row count says."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from flexgen_helm.compression.grids import WeightCompression, tensor_compression
from flexgen_helm.compression.int4 import CompressedWeight, kernel_rows
from flexgen_helm.compression.stored import Stored, encode, stored_nbytes, weight_groups, weight_layout
from flexgen_helm.dense_linear import PackedLinear, packs_linear_weights
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.host_allocator import release_freed_host_memory
from flexgen_helm.memory.placement import Segment
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.models.spec import LayerSpec, TensorSpec, all_store_tensors, is_lookup_table
from flexgen_helm.policy.policy import Compression


@dataclass
class WeightHome:
    spec: TensorSpec
    segments: list[Segment]
    data: list[Stored | None] = field(default_factory=list)  # None: read from the store on use
    compression: Compression | None = None
    layout: str | None = None  # the int4 kernel layout its compressed parts are packed in

    @property
    def group_dim(self) -> int | None:
        return weight_groups(self.compression, self.spec.shape)


def segment_nbytes(spec: TensorSpec, segment: Segment, compression: Compression | None, dtype: torch.dtype) -> int:
    """Bytes a segment of a weight takes on its tier, compressed or not. Placement cuts
    compressed rows on group boundaries, so a segment quantized alone weighs the same."""
    shape = (segment.rows, *spec.shape[1:])
    return stored_nbytes(shape, dtype, compression, weight_groups(compression, spec.shape))


def load_nbytes(spec: TensorSpec, segments: list[Segment], compression: Compression | None, dtype: torch.dtype,
                cuda: bool) -> int:
    """Bytes one load of a weight (load_home) makes beside its homes: its disk parts as read,
    the whole tensor again where it is split over tiers (the copy that assembles it), and on
    a GPU its host parts copied over."""
    split = len(segments) > 1
    return sum(segment_nbytes(spec, s, compression, dtype) * (split + (s.tier == "disk" or (s.tier == "cpu" and cuda)))
               for s in segments)


def build_homes(layers: list[LayerSpec], placement: dict[str, list[Segment]], devices: Devices,
                read_full: Callable[[str], torch.Tensor], usage: TierUsage, pin: bool,
                compression: WeightCompression = None, progress: bool = False,
                compressed_store=None) -> dict[str, WeightHome]:
    """Fill the gpu and cpu tiers from `read_full(store_name)` - quantized here, or, when a
    compressed store is given, its compressed weights as the conversion wrote them; disk
    segments stay in the store."""
    homes: dict[str, WeightHome] = {}
    specs = all_store_tensors(layers)
    # A tensor's read and conversion copies, freed once it is home, are kept by the engine's
    # allocator setting (host_allocator.py), and the next home, allocated into their space,
    # may leave too little of it for the next copies: OPT-6.7B's 4-bit weights (3.5 GiB in RAM)
    # peaked at 8.2-17.9 GiB RSS in four runs on 2026-11-24 (not in a fifth, 4.6 GiB; 4.4-4.7
    # with the setting off; runs/compare/opt-6.7b-p512-g32/placement-rss). So what is freed
    # beyond two dense copies of the largest tensor is handed back as placement goes. A look
    # asks malloc to walk its free lists (2-7 ms once the heap is fragmented: a look per tensor
    # was 0.8 s of SmolLM2's 4.2 s load), so one is taken only once the tensors placed since
    # the last look add up to the largest one: what they freed stays within one more such copy.
    elt = torch.empty((), dtype=devices.dtype).element_size()
    largest = max(math.prod(s.shape) for s in specs) * elt
    keep_freed = 2 * largest
    placed_since_look = largest  # look before the first tensor
    packable = _multiplied_only(layers) if packs_linear_weights(devices.compute, devices.dtype) else set()
    for spec in tqdm(specs, desc="placing weights", unit="tensor", disable=not progress):
        if placed_since_look >= largest:
            release_freed_host_memory(keep_freed)
            placed_since_look = 0
        placed_since_look += math.prod(spec.shape) * elt
        own = tensor_compression(compression, spec.store_name, spec.shape)
        home = WeightHome(spec, placement[spec.store_name], compression=own,
                          layout=weight_layout(own, spec.shape, devices.dtype, devices.compute))
        full = None
        in_memory = any(s.tier != "disk" for s in home.segments)
        if in_memory and compressed_store is not None and home.group_dim is not None:
            full = compressed_store.read(spec.store_name, rows=(0, spec.shape[0]), verify=True)
        elif in_memory:
            full = encode(read_full(spec.store_name).to(devices.dtype), home.compression, home.group_dim, home.layout)
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
            if spec.store_name in packable and home.compression is None and len(home.segments) == 1:
                part = PackedLinear(part)  # its only copy from now on: the plain one is freed with `full`
            home.data.append(part)
        homes[spec.store_name] = home
    return homes


def _multiplied_only(layers: list[LayerSpec]) -> set[str]:
    """Store names of the 2-D weights the layers only multiply with (models/linear.linear),
    never look rows up in (a tied embedding is both): those a PackedLinear can hold."""
    lookups = {t.store_name for layer in layers for t in layer.tensors if is_lookup_table(layer, t.key)}
    return {t.store_name for layer in layers for t in layer.tensors
            if len(t.shape) == 2 and t.store_name not in lookups}


def read_parts(home: WeightHome, store) -> list[Stored]:
    """A weight's parts as held: its memory tiers' in place, its disk segments read."""
    return [p if p is not None else store.read(home.spec.store_name, rows=(s.start, s.end))
            for s, p in zip(home.segments, home.data)]


def load_home(home: WeightHome, devices: Devices, store, parts: list[Stored] | None = None
              ) -> torch.Tensor | CompressedWeight:
    """The whole tensor on the compute device, in the compute dtype (`parts`: read_parts'
    answer, when the reads were made already).

    A plain tensor whose home is one tier of the compute device's memory is used in place;
    otherwise its parts are copied to the compute device (the weight I/O, compressed bytes
    when compressed). A compressed one stays compressed: a CompressedWeight of its parts."""
    parts = read_parts(home, store) if parts is None else parts
    if home.group_dim is not None:
        # a part held in the compute device's memory is there already: not even bundle.to's look at
        # its tensors (an OLMoE expert's load of three 4-bit weights, 4-layer decode: 19 -> 13 us)
        on_device = [(s.start, p if s.tier != "disk" and devices.tier_device(s.tier) == devices.compute
                      else p.to(devices.compute, non_blocking=True)) for s, p in zip(home.segments, parts)]
        rows = kernel_rows(home.layout, devices.compute.type)
        return CompressedWeight(on_device, home.spec.shape, devices.dtype, rows)
    if isinstance(parts[0], PackedLinear):  # in the compute device's memory, where it was packed
        return parts[0]
    if len(parts) == 1:
        return parts[0].to(devices.compute, non_blocking=True)
    out = torch.empty(home.spec.shape, dtype=devices.dtype, device=devices.compute)
    for s, part in zip(home.segments, parts):
        out[s.start:s.end].copy_(part, non_blocking=True)
    return out


# A layer whose disk reads are all smaller than this has them in flight together (load_layer)
FAN_OUT_BELOW = 16 << 20


def load_layer(layer: LayerSpec, homes: dict[str, WeightHome], devices: Devices, store,
               loaded: dict | None = None, map_reads: Callable | None = None
               ) -> dict[str, torch.Tensor | CompressedWeight]:
    """The layer's weights by key; those in `loaded` (by store name: a tied weight another
    layer has just loaded) are used as they are instead of loaded again.

    `map_reads(fn, items)`: `[fn(x) for x in items]` with the calls running at once
    (CopyEngine.fan_out). A layer whose disk reads are all small has them go through it, in
    flight together: one at a time, each of a 4-bit layer's many small reads waited for the
    one before. Layers of large reads (each already cut into the profile's reads in flight)
    keep reading one tensor at a time, as before, until a measurement can tell the two ways
    apart for them. OPT-1.3B's blocks off disk with a bf16 matmul loop running beside (2-core
    EPYC, 2026-11-24; runs/bench/compression/disk_reads/layer_reads.py, medians of 3 passes,
    two runs): 4-bit (2.4 and 9.4 MB reads, ten tiny ones) 1.10-1.27 GB/s one at a time,
    1.47-1.55 together, and 9.7 -> 13.2-14.2 decode tok/s end to end; bf16 (8 and 34 MB)
    1.24-1.54 against 1.60-1.71 there, but the opposite in an earlier scratch run, and its
    end-to-end rows moved by 20% with identical code (the disk's drift). Only the reads
    run there: the copies to the device stay on the caller's thread (its CUDA stream)."""
    loaded = loaded or {}
    names = list(dict.fromkeys(t.store_name for t in layer.tensors if t.store_name not in loaded))
    on_disk = [n for n in names if any(p is None for p in homes[n].data)]
    parts = {}
    if (map_reads is not None and len(on_disk) > 1
            and max(_disk_nbytes(homes[n], devices.dtype) for n in on_disk) < FAN_OUT_BELOW):
        parts = dict(zip(on_disk, map_reads(lambda n: read_parts(homes[n], store), on_disk)))
    weights = {**loaded, **{n: load_home(homes[n], devices, store, parts.get(n)) for n in names}}
    return {t.key: weights[t.store_name] for t in layer.tensors}


def _disk_nbytes(home: WeightHome, dtype: torch.dtype) -> int:
    return sum(segment_nbytes(home.spec, s, home.compression, dtype) for s in home.segments if s.tier == "disk")


def home_bytes(homes: dict[str, WeightHome], dtype: torch.dtype) -> dict[str, int]:
    """Bytes of weights on each tier, as placed (compressed bytes when compressed)."""
    out = {"gpu": 0, "cpu": 0, "disk": 0}
    for h in homes.values():
        for s in h.segments:
            out[s.tier] += segment_nbytes(h.spec, s, h.compression, dtype)
    return out
