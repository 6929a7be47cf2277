"""A model made ready to run under a policy: its math, its placed weights, its devices."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch

from flexgen_helm.compression.grids import WeightCompression
from flexgen_helm.executor.kept_weights import KeptDenseWeights
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.host_allocator import big_allocations_outside_heap
from flexgen_helm.memory.placement import Segment, achieved_fractions
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.memory.weight_homes import WeightHome, home_bytes, load_layer
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.spec import LayerSpec
from flexgen_helm.weights.compressed_store import CompressedStore
from flexgen_helm.weights.store import TensorStore


@dataclass
class ModelRuntime:
    config: ModelConfig
    family: ModuleType
    layers: list[LayerSpec]
    placement: dict[str, list[Segment]]
    homes: dict[str, WeightHome]
    store: TensorStore | CompressedStore | None
    devices: Devices
    usage: TierUsage
    # layer name -> how its experts load, worked out once (executor/expert_weights.sparse_layer_plan)
    expert_plans: dict = field(default_factory=dict)
    # the dense copies of compressed weights the blocks keep, across blocks (dense_copies)
    kept: KeptDenseWeights | None = None
    # a layer whose weights load_layer uses in place, and those weights, by the spec itself (its
    # id, checked by identity): a sparse MoE block loads each expert as a spec of its own too
    # (executor/expert_weights.py), and keyed by (kind, index) each evicted the block's entry
    # (bf16 OLMoE experts in RAM: 7.8 -> 1.1 us an expert's load)
    _in_place: dict[int, tuple[LayerSpec, dict]] = field(default_factory=dict)
    # On a GPU, wait for the device at the end of every timed stretch of compute, so that the
    # stage timers hold the GPU's time (`flexgen-helm bench --breakdown`). Off, the host queues
    # each layer's kernels while the GPU still runs the last, and the compute timers hold the
    # host's time. A CPU computes synchronously: its timers are exact either way.
    sync_stage_timers: bool = False
    # each weight's compression as stored (a GGUF's own codes resolved tensor by tensor:
    # weights/source_grids.py), for the planner to price a scenario's block with (helm/block_planning.py)
    weight_compression: WeightCompression = None

    def dense_copies(self, keep: bool, across_blocks: bool) -> KeptDenseWeights | None:
        """Where a block keeps the dense copies of its compressed weights (Policy.keep_dense_weights;
        None where it does not). across_blocks: every block's copies are the same (the
        weights are all in the compute tier's memory, where a layer's load is its home, and
        only the copies are extra, counted in `usage`), so they are made all at once, at load
        or for the first block that keeps them (KeptDenseWeights.make_all), and kept for every
        block after it: a HELM run of many blocks, or of several scenarios, dequantizes each
        weight once. Otherwise the block gets copies of its own, made at each weight's first
        multiply, which it releases when it ends (several blocks may be alive at once: a
        pipeline's micro-batch groups); and a block that keeps none, or none across blocks,
        first lets go of those kept across blocks."""
        if not (keep and across_blocks):
            self.release_dense_copies()  # before the block allocates anything of its own
            return KeptDenseWeights(self.usage) if keep else None  # the block's own: it releases them
        if self.kept is None:
            self.kept = KeptDenseWeights(self.usage)
            self.kept.make_all(self.load_layer, self.layers)
        return self.kept

    def release_dense_copies(self) -> None:
        """Let go of the dense copies kept across blocks, if any."""
        if self.kept is not None:
            self.kept.release()
            self.kept = None

    def make_dense_copies(self, policy) -> float:
        """Where `policy` keeps dense copies of compressed weights across blocks, make them all
        now (dense_copies); the seconds it took (0.0: none kept across blocks)."""
        if not (policy.keep_dense_weights and policy.dense_copies_across_blocks):
            return 0.0
        start = time.perf_counter()
        # apart from the heap, so that the temporaries they are made through leave no holes
        # between them for the run's activations to fault in again (host_allocator.py)
        with big_allocations_outside_heap():
            self.dense_copies(True, True)
        return time.perf_counter() - start

    def load_layer(self, layer: LayerSpec, loaded: dict | None = None,
                   map_reads: Callable | None = None) -> dict[str, torch.Tensor]:
        """`loaded`: weights already on the compute device, by store name, to use as they are;
        `map_reads`: runs the reads of the tensors on disk at once (memory/weight_homes.load_layer).
        A layer whose every weight is used where it lives (whole, uncompressed, in the compute
        device's memory) loads as the same tensors every time: that answer is kept and given
        again. Working it out took a fifth of a decode step's host time, per layer and step, which
        on a GPU is what a step waits for (runs/gpu/h200-2026-11-28/README.md, section 3)."""
        held = self._in_place.get(id(layer))
        if held is not None and held[0] is layer:
            return dict(held[1])
        weights = load_layer(layer, self.homes, self.devices, self.store, loaded, map_reads)
        if all(_is_home(self.homes[t.store_name], weights[t.key]) for t in layer.tensors):
            self._in_place[id(layer)] = (layer, weights)
        return dict(weights)

    def placement_report(self) -> dict:
        return {
            "weight_fractions": achieved_fractions(self.layers, self.placement),
            "weight_bytes": home_bytes(self.homes, self.devices.dtype),
        }


def _is_home(home: WeightHome, weight) -> bool:
    """Whether `weight` is the one tensor that `home` holds (no copy, no read made it)."""
    return len(home.data) == 1 and weight is home.data[0]
