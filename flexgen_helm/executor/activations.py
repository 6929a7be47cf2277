"""The hidden states of one GPU batch between layers, split by sequence over the tiers."""

from __future__ import annotations

from pathlib import Path

import torch

from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.disk_buffer import DiskBuffer
from flexgen_helm.memory.usage import TierUsage, tensor_bytes
from flexgen_helm.policy.policy import TIERS


class ActivationHome:
    def __init__(self, rows: dict[str, int], max_len: int, hidden: int, devices: Devices,
                 usage: TierUsage, disk_path: Path | None):
        self.rows, self.devices, self.usage = rows, devices, usage
        self.parts: dict[str, torch.Tensor] = {}
        self.shape = None
        self.disk = None
        if rows["disk"]:
            self.disk = DiskBuffer(disk_path, self.disk_nbytes(rows["disk"], max_len, hidden, devices.dtype))

    @staticmethod
    def disk_nbytes(disk_rows: int, max_len: int, hidden: int, dtype: torch.dtype) -> int:
        """The size of the disk file, known before it is made."""
        return disk_rows * max_len * hidden * torch.empty((), dtype=dtype).element_size()

    def store(self, h: torch.Tensor) -> None:
        self._release()
        self.shape = tuple(h.shape)
        start = 0
        for tier in TIERS:
            n = self.rows[tier]
            part = h[start:start + n]
            start += n
            if n == 0:
                continue
            if tier == "disk":
                self.disk.write(0, part)
                self.usage.add("disk", tensor_bytes(part))
                self.parts["disk"] = None
            else:
                self.parts[tier] = part.to(self.devices.tier_device(tier), non_blocking=True)
                self.usage.add(tier, tensor_bytes(part))

    def load(self) -> torch.Tensor:
        """The whole hidden state on the compute device."""
        pieces = []
        for tier in TIERS:
            n = self.rows[tier]
            if n == 0:
                continue
            if tier == "disk":
                part = self.disk.read(0, (n, *self.shape[1:]), self.devices.dtype)
            else:
                part = self.parts[tier]
            pieces.append(part.to(self.devices.compute, non_blocking=True))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _release(self) -> None:
        if self.shape is None:
            return
        per_row = tensor_bytes(torch.empty(self.shape[1:], dtype=self.devices.dtype, device="meta"))
        for tier in self.parts:
            self.usage.remove(tier, self.rows[tier] * per_row)
        self.parts.clear()

    def close(self) -> None:
        self._release()
        if self.disk is not None:
            self.disk.close()
