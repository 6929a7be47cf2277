"""A mixture-of-experts block's weights loaded as its router asks for them.

A sparse block's layer load (on the weights lane, ahead of its compute, like any layer's)
brings everything but the experts: attention, norms, the router, a shared expert. The
experts wait for the router: the block's math (models/moe.expert_mlp) names the experts its
rows chose (`fetch`) before it multiplies any, and each chosen expert held off the compute
device's memory (on disk; on a GPU machine, in host memory) is loaded once per layer and
step, one load per expert on the weights lane, so the first expert computes while the next
ones load, and is released once its rows are done (the block's rows come in one call: the
schedule gathers a prefill's GPU batches as a decode step merges them), so a loaded layer
holds its attention and the experts in flight, not all of them. An expert the block's
tokens never chose is never read. An expert whose rows all sit in the compute device's
memory is used in place, with no hop to the lane.

Counted in the schedule's timers (beside its seconds): "{stage}_experts_loaded" (experts
read off a lower tier) and "{stage}_expert_read_bytes" (their bytes as stored: the disk's
reads, and on a GPU the host-to-device copies), written by the weights lane only (inline,
with overlap off); "wait_load_experts", seconds the compute thread waited for an expert (part of
its stage's compute time: the wait happens inside the block's math).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from flexgen_helm.memory.copy_engine import consume
from flexgen_helm.memory.weight_homes import segment_nbytes
from flexgen_helm.models.spec import LayerSpec

EXPERT_PREFIX = "experts."
# experts read off lower tiers at once (each one's three tensors' reads together), ahead of the
# one computing: enough to keep the disk busy while it multiplies, few enough that a layer's
# experts are not all held at once
EXPERTS_IN_FLIGHT = 3


def expert_of(key: str) -> int | None:
    """The expert index of a weight key ("experts.{e}.up_proj.weight"), None for the others."""
    return int(key.split(".")[1]) if key.startswith(EXPERT_PREFIX) else None


@dataclass(frozen=True)
class ExpertLoad:
    spec: LayerSpec  # the expert's tensors, as a layer of their own to load
    moved_nbytes: int  # what a load reads off tiers other than the compute device's memory


@dataclass(frozen=True)
class SparseLayerPlan:
    ahead: LayerSpec  # the block without its experts: loaded ahead, like any layer
    experts: dict[int, ExpertLoad]


def sparse_layer_plan(rt, layer: LayerSpec) -> SparseLayerPlan | None:
    """How a layer with experts loads (None: it has none), worked out once per run."""
    if layer.name not in rt.expert_plans:
        by_expert: dict[int, list] = {}
        for t in layer.tensors:
            e = expert_of(t.key)
            if e is not None:
                by_expert.setdefault(e, []).append(t)
        plan = None
        if by_expert:
            devices = rt.devices
            loads = {}
            for e, tensors in by_expert.items():
                moved = sum(segment_nbytes(t, s, rt.homes[t.store_name].compression, devices.dtype)
                            for t in tensors for s in rt.homes[t.store_name].segments
                            if s.tier == "disk" or devices.tier_device(s.tier) != devices.compute)
                loads[e] = ExpertLoad(dataclasses.replace(layer, tensors=tuple(tensors)), moved)
            ahead = dataclasses.replace(layer, tensors=tuple(t for t in layer.tensors if expert_of(t.key) is None))
            plan = SparseLayerPlan(ahead, loads)
        rt.expert_plans[layer.name] = plan
    return rt.expert_plans[layer.name]


class ExpertsOnDemand(dict):
    """The layer's weights by key: what was loaded ahead, plus each expert once fetched.
    after_release: called once an expert's rows are done (the schedule hands back freed host
    memory there: each expert's buffers differ in size with its rows, and over a block-sized
    prefill their holes add up)."""

    def __init__(self, loaded: dict, plan: SparseLayerPlan, rt, io, timers: dict, stage: str,
                 after_release: Callable[[], None] | None = None):
        super().__init__(loaded)
        self._plan, self._rt, self._io, self._timers, self._stage = plan, rt, io, timers, stage
        self._after_release = after_release
        self._queued: deque[int] = deque()  # fetched, not sent to the lane yet
        self._pending: dict[int, object] = {}  # expert -> future of its weights (None: loaded)
        self._in_flight = 0

    def _load(self, e: int) -> dict:
        return self._rt.load_layer(self._plan.experts[e].spec, map_reads=self._io.fan_out)  # its reads at once

    def _load_counted(self, e: int) -> dict:
        weights = self._load(e)
        self._timers[f"{self._stage}_experts_loaded"] += 1
        self._timers[f"{self._stage}_expert_read_bytes"] += self._plan.experts[e].moved_nbytes
        return weights

    def fetch(self, experts) -> None:
        """Load these experts (those not loaded or on their way yet), in this order, at most
        EXPERTS_IN_FLIGHT at a time off the lower tiers."""
        for e in experts:
            if e in self._pending or e in self._queued or e not in self._plan.experts:
                continue
            if self._plan.experts[e].moved_nbytes:
                self._queued.append(e)
            else:  # in the compute device's memory: used in place
                self._pending[e] = None
                self.update(self._load(e))
        self._send()

    def _send(self) -> None:
        while self._queued and self._in_flight < EXPERTS_IN_FLIGHT:
            e = self._queued.popleft()
            self._pending[e] = self._io.submit(self._load_counted, e, kind=f"{self._stage}_load_weight",
                                               lane="weights")
            self._in_flight += 1

    def release(self, e: int) -> None:
        """Drop expert e's weights (its rows are done): a step's experts are not held together.
        A later use loads it again (counted again)."""
        if e in self._plan.experts:
            for t in self._plan.experts[e].spec.tensors:
                self.pop(t.key, None)
        if self._pending.get(e) is not None:  # never waited for: wait, so that the lane's count holds
            self._wait(e)
            self.release(e)
            return
        self._pending.pop(e, None)
        if self._after_release is not None:
            self._after_release()

    def __missing__(self, key: str):
        e = expert_of(key)
        if e is None or e not in self._plan.experts:
            raise KeyError(key)
        if e not in self._pending:
            if e in self._queued:
                self._queued.remove(e)
                self._queued.appendleft(e)  # wanted now: first to go
            self.fetch([e])
            while e not in self._pending:  # the lane is full of others: take them in turn
                self._wait(next(x for x, f in self._pending.items() if f is not None))
        if self._pending[e] is not None:
            self._wait(e)
        return dict.__getitem__(self, key)

    def _wait(self, e: int) -> None:
        t0 = time.perf_counter()
        self.update(consume(self._pending[e].result(), self._rt.devices.compute))
        self._pending[e] = None
        self._in_flight -= 1
        self._timers["wait_load_experts"] += time.perf_counter() - t0
        self._send()


def load_layer_weights(rt, io, timers: dict, stage: str, layer: LayerSpec, loaded: dict | None = None,
                       after_release: Callable[[], None] | None = None) -> dict:
    """rt.load_layer, but a sparse block's experts are left for its router (ExpertsOnDemand)."""
    plan = sparse_layer_plan(rt, layer)
    if plan is None:
        return rt.load_layer(layer, loaded, map_reads=io.fan_out)
    return ExpertsOnDemand(rt.load_layer(plan.ahead, loaded, map_reads=io.fan_out), plan, rt, io, timers, stage,
                           after_release)
