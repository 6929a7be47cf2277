"""Placement by fraction: which rows of which tensor live on which tier.

Fractions are honoured to within one row of one tensor per layer (one quantization group
of rows when compressed weights are grouped along rows; FlexGen placed whole tensors and
so turned 20% into 8.3% for OPT-30B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flexgen_helm.compression.stored import row_alignment
from flexgen_helm.models.spec import LayerSpec, TensorSpec, all_store_tensors
from flexgen_helm.policy.policy import TIERS, Compression, Split


@dataclass(frozen=True)
class Segment:
    tier: str
    start: int  # first row
    end: int  # one past the last row

    @property
    def rows(self) -> int:
        return self.end - self.start


def split_count(n: int, split: Split) -> dict[str, int]:
    """Split n units over the tiers, rounding so the counts add up to n."""
    gpu = round(n * split.gpu)
    cpu = min(n - gpu, round(n * (split.gpu + split.cpu)) - gpu)
    return {"gpu": gpu, "cpu": cpu, "disk": n - gpu - cpu}


def cumulative_split_count(n: int, split: Split, index: int) -> dict[str, int]:
    """Like split_count, for the index-th of many groups of n units, carrying each group's
    rounding into the next so that the totals over all groups stay exact."""
    def edge(fraction: float) -> int:
        return round(n * (index + 1) * fraction) - round(n * index * fraction)

    gpu = min(max(edge(split.gpu), 0), n)
    gpu_cpu = min(max(edge(split.gpu + split.cpu), gpu), n)
    return {"gpu": gpu, "cpu": gpu_cpu - gpu, "disk": n - gpu_cpu}


def place_layer(tensors: tuple[TensorSpec, ...], split: Split, align: Callable[[TensorSpec], int] = lambda t: 1
                ) -> dict[str, list[Segment]]:
    """Segments for each tensor of one layer: the first `gpu` fraction of the layer's
    elements (in tensor order, at row granularity) on the GPU tier, the next `cpu` fraction
    on the CPU tier, the rest on disk. A cut inside a tensor falls on a multiple of
    align(tensor) rows (or the tensor's end): quantized weights whose groups run along the
    rows must keep whole groups on each tier, so their cuts move by up to half a group."""
    total = sum(t.numel for t in tensors)
    edges = (split.gpu * total, (split.gpu + split.cpu) * total)
    out: dict[str, list[Segment]] = {}
    offset = 0  # elements of the layer before this tensor
    for t in tensors:
        step = align(t)
        cuts = [0]
        for edge in edges:
            exact = (edge - offset) / t.row_numel if t.row_numel else 0.0  # rows before the edge
            cut = round(exact / step) * step
            if abs(t.rows - exact) <= abs(cut - exact):  # the tensor's end is a boundary too
                cut = t.rows
            cuts.append(min(max(cut, cuts[-1]), t.rows))
        cuts.append(t.rows)
        out[t.store_name] = [Segment(tier, a, b) for tier, a, b in zip(TIERS, cuts, cuts[1:]) if b > a]
        offset += t.numel
    return out


def place_weights(layers: list[LayerSpec], split: Split, compression: Compression | None = None
                  ) -> dict[str, list[Segment]]:
    """Segments of every stored tensor. A tied tensor is placed with the first of the given
    layers that uses it (a pipeline stage may hold the head but not the embedding)."""
    placement: dict[str, list[Segment]] = {}
    for layer in layers:
        fresh = tuple(t for t in layer.tensors if t.store_name not in placement)
        placement.update(place_layer(fresh, split, lambda t: row_alignment(compression, t.shape)))
    return placement


def achieved_fractions(layers: list[LayerSpec], placement: dict[str, list[Segment]]) -> dict[str, float]:
    sizes = {t.store_name: t for t in all_store_tensors(layers)}
    per_tier = {t: 0 for t in TIERS}
    for name, segments in placement.items():
        for s in segments:
            per_tier[s.tier] += s.rows * sizes[name].row_numel
    total = sum(per_tier.values()) or 1
    return {t: per_tier[t] / total for t in TIERS}
