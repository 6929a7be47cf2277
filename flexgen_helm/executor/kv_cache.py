"""The KV cache of one (layer, GPU batch), split by units over the tiers.

Every tier keeps the sequence-major layout (max_len, units, head_dim), so the cache of
positions [0, t) is one contiguous range (one disk read) and a decode step appends one
contiguous row (one disk write)."""

from __future__ import annotations

from pathlib import Path

import torch

from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.disk_buffer import DiskBuffer
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy.policy import TIERS


class KVCacheSlot:
    def __init__(self, units: dict[str, int], max_len: int, head_dim: int, devices: Devices,
                 usage: TierUsage, disk_path: Path | None, pin: bool):
        self.units = units
        self.ranges = {}
        start = 0
        for tier in TIERS:
            self.ranges[tier] = (start, start + units[tier])
            start += units[tier]
        self.max_len, self.head_dim, self.devices, self.usage = max_len, head_dim, devices, usage
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.disk: DiskBuffer | None = None
        elt = torch.empty((), dtype=devices.dtype).element_size()
        for tier in ("gpu", "cpu"):
            if units[tier]:
                shape = (max_len, units[tier], head_dim)
                kwargs = {"pin_memory": True} if (tier == "cpu" and pin and devices.is_cuda) else {}
                self.k[tier] = torch.empty(shape, dtype=devices.dtype, device=devices.tier_device(tier), **kwargs)
                self.v[tier] = torch.empty(shape, dtype=devices.dtype, device=devices.tier_device(tier), **kwargs)
                usage.add(tier, 2 * max_len * units[tier] * head_dim * elt)
        if units["disk"]:
            self._disk_half = max_len * units["disk"] * head_dim * elt
            self.disk = DiskBuffer(disk_path, 2 * self._disk_half)
            usage.add("disk", 2 * self._disk_half)
        self._row_bytes = units["disk"] * head_dim * elt

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store k, v of shape (s, units, d) at positions [start, start + s)."""
        s = k.shape[0]
        for tier in TIERS:
            a, b = self.ranges[tier]
            if a == b:
                continue
            if tier == "disk":
                self.disk.write(start * self._row_bytes, k[:, a:b])
                self.disk.write(self._disk_half + start * self._row_bytes, v[:, a:b])
            else:
                self.k[tier][start:start + s].copy_(k[:, a:b], non_blocking=True)
                self.v[tier][start:start + s].copy_(v[:, a:b], non_blocking=True)

    def read(self, tier: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, length) of a tier's units, where they live (disk: into CPU memory)."""
        if tier != "disk":
            return self.k[tier][:length], self.v[tier][:length]
        shape = (length, self.units["disk"], self.head_dim)
        dtype = self.devices.dtype
        return self.disk.read(0, shape, dtype), self.disk.read(self._disk_half, shape, dtype)

    def close(self) -> None:
        elt = torch.empty((), dtype=self.devices.dtype).element_size()
        for tier in ("gpu", "cpu"):
            if self.units[tier]:
                self.usage.remove(tier, 2 * self.max_len * self.units[tier] * self.head_dim * elt)
        self.k.clear()
        self.v.clear()
        if self.disk is not None:
            self.usage.remove("disk", 2 * self._disk_half)
            self.disk.close()
