"""Placement by fraction: which rows of which tensor live on which tier.

Fractions are honoured to within one row of one tensor per layer (one quantization group
of rows when compressed weights are grouped along rows; FlexGen placed whole tensors and
so turned 20% into 8.3% for OPT-30B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from flexgen_helm.compression.grids import WeightCompression, tensor_compression
from flexgen_helm.compression.stored import row_alignment
from flexgen_helm.models.spec import LayerSpec, TensorSpec, all_store_tensors
from flexgen_helm.policy.policy import TIERS, Split


@dataclass(frozen=True)
class Segment:
    tier: str
    start: int  # first row
    end: int  # one past the last row

    @property
    def rows(self) -> int:
        return self.end - self.start


def split_in_turn(split: Split, sizes: Iterable[int]) -> Iterator[dict[str, int]]:
    """Each group of sizes[i] units over the tiers, in turn: every group splits by the
    fractions, and the rounding carries into the next through the totals placed so far.
    The gpu total stays within half a unit of its share, the others within 2.5 units (the
    gpu+cpu edge of a group may not fall below its gpu edge, which can hold the cpu total
    up to two units above its share for a while). Carrying each edge on its own instead
    drifted without bound: seven batches of one sequence split 40/20/40 came out 3/4/0 (now 3/2/2)."""
    seen = gpu_total = upper_total = 0  # upper: units on the gpu and cpu tiers
    for n in sizes:
        seen += n
        gpu = min(max(round(seen * split.gpu) - gpu_total, 0), n)
        upper = min(max(round(seen * (split.gpu + split.cpu)) - upper_total, gpu), n)
        gpu_total, upper_total = gpu_total + gpu, upper_total + upper
        yield {"gpu": gpu, "cpu": upper - gpu, "disk": n - upper}


def slot_tier_counts(split: Split, batch_units: Sequence[int], layers: Iterable[int] = (0,)
                     ) -> dict[tuple[int, int], dict[str, int]]:
    """Units on each tier of the slot of every (layer, GPU batch), batch k holding
    batch_units[k] units: the KV cache (sequences x KV heads, a slot per block layer) and the
    activations (sequences, one slot per batch). The schedule allocates these and the budget
    plans them. The slots split in turn, layer by layer from layer 0, so a pipeline stage's
    slots are those of the whole model."""
    wanted = set(layers)
    if not wanted:
        return {}
    nb = len(batch_units)
    slots = [(layer, k) for layer in range(max(wanted) + 1) for k in range(nb)]
    counts = split_in_turn(split, (batch_units[k] for _, k in slots))
    return {slot: c for slot, c in zip(slots, counts) if slot[0] in wanted}


def tier_totals(counts: dict[tuple[int, int], dict[str, int]]) -> dict[str, int]:
    return {t: sum(c[t] for c in counts.values()) for t in TIERS}


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


def place_weights(layers: list[LayerSpec], split: Split, compression: WeightCompression = None
                  ) -> dict[str, list[Segment]]:
    """Segments of every stored tensor. A tied tensor is placed with the first of the given
    layers that uses it (a pipeline stage may hold the head but not the embedding)."""
    placement: dict[str, list[Segment]] = {}
    for layer in layers:
        fresh = tuple(t for t in layer.tensors if t.store_name not in placement)
        placement.update(place_layer(fresh, split, lambda t: row_alignment(
            tensor_compression(compression, t.store_name, t.shape), t.shape)))
    return placement


def achieved_fractions(layers: list[LayerSpec], placement: dict[str, list[Segment]]) -> dict[str, float]:
    sizes = {t.store_name: t for t in all_store_tensors(layers)}
    per_tier = {t: 0 for t in TIERS}
    for name, segments in placement.items():
        for s in segments:
            per_tier[s.tier] += s.rows * sizes[name].row_numel
    total = sum(per_tier.values()) or 1
    return {t: per_tier[t] / total for t in TIERS}
