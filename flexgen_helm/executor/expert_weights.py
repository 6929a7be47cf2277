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


class ExpertsOnDemand(dict):
    """The layer's weights by key: what was loaded ahead, plus each expert once fetched."""

    def __init__(self, loaded: dict, layer: LayerSpec, rt, io, timers: dict, stage: str):
        super().__init__(loaded)
        self._rt, self._io, self._timers, self._stage = rt, io, timers, stage
        self._specs: dict[int, list] = {}
        for t in layer.tensors:
            e = expert_of(t.key)
            if e is not None:
                self._specs.setdefault(e, []).append(t)
        self._layer = layer
        self._queued: deque[int] = deque()  # fetched, not sent to the lane yet
        self._pending: dict[int, object] = {}  # expert -> future of its weights (None: loaded)

    def _moved_nbytes(self, e: int) -> int:
        """Bytes a load of expert e reads off tiers other than the compute device's memory."""
        devices = self._rt.devices
        total = 0
        for t in self._specs[e]:
            home = self._rt.homes[t.store_name]
            total += sum(segment_nbytes(t, s, home.compression, devices.dtype) for s in home.segments
                         if s.tier == "disk" or devices.tier_device(s.tier) != devices.compute)
        return total

    def _load(self, e: int) -> dict:
        spec = dataclasses.replace(self._layer, tensors=tuple(self._specs[e]))
        return self._rt.load_layer(spec, map_reads=self._io.fan_out)  # its three reads at once

    def _load_counted(self, e: int, nbytes: int) -> dict:
        weights = self._load(e)
        self._timers[f"{self._stage}_experts_loaded"] += 1
        self._timers[f"{self._stage}_expert_read_bytes"] += nbytes
        return weights

    def fetch(self, experts) -> None:
        """Load these experts (those not loaded or on their way yet), in this order, at most
        EXPERTS_IN_FLIGHT at a time off the lower tiers."""
        for e in experts:
            if e in self._pending or e in self._queued or e not in self._specs:
                continue
            nbytes = self._moved_nbytes(e)
            if nbytes:
                self._queued.append(e)
            else:  # in the compute device's memory: used in place
                self._pending[e] = None
                self.update(self._load(e))
        self._send()

    def _send(self) -> None:
        in_flight = sum(f is not None for f in self._pending.values())
        while self._queued and in_flight < EXPERTS_IN_FLIGHT:
            e = self._queued.popleft()
            self._pending[e] = self._io.submit(self._load_counted, e, self._moved_nbytes(e),
                                               kind=f"{self._stage}_load_weight", lane="weights")
            in_flight += 1

    def release(self, e: int) -> None:
        """Drop expert e's weights (its rows are done): a step's experts are not held together.
        A later use loads it again (counted again)."""
        for t in self._specs.get(e, ()):
            self.pop(t.key, None)
        self._pending.pop(e, None)

    def __missing__(self, key: str):
        e = expert_of(key)
        if e is None or e not in self._specs:
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
        self._timers["wait_load_experts"] += time.perf_counter() - t0
        self._send()


def load_layer_weights(rt, io, timers: dict, stage: str, layer: LayerSpec, loaded: dict | None = None) -> dict:
    """rt.load_layer, but a sparse block's experts are left for its router (ExpertsOnDemand)."""
    if not any(expert_of(t.key) is not None for t in layer.tensors):
        return rt.load_layer(layer, loaded, map_reads=io.fan_out)
    ahead = dataclasses.replace(layer, tensors=tuple(t for t in layer.tensors if expert_of(t.key) is None))
    return ExpertsOnDemand(rt.load_layer(ahead, loaded, map_reads=io.fan_out), layer, rt, io, timers, stage)
