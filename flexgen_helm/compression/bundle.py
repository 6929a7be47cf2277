"""What a compressed tensor's stored parts do together: move, pin, copy and weigh as one."""

from __future__ import annotations

import dataclasses

import torch


class TensorBundle:
    """Mixin for a dataclass whose tensor fields are the stored parts of one tensor (codes,
    scales, ...): every tensor field (and every part of a bundle field) travels together,
    the other fields (shape, group size, ...) stay as they are."""

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors, in field order (a bundle field's parts in its place)."""
        out = []
        for v in (getattr(self, f.name) for f in dataclasses.fields(self)):
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, TensorBundle):
                out.extend(v.parts)
        return tuple(out)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def to(self, device, non_blocking: bool = False):
        device = torch.device(device)
        if all(t.device == device for t in self.parts):  # a CPU-only step's every load: nothing moves
            return self
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self):
        return self._map(lambda t: t.pin_memory())

    def clone(self):
        return self._map(lambda t: t.clone())

    def _map(self, fn):
        changes = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                changes[f.name] = fn(v)
            elif isinstance(v, TensorBundle):
                changes[f.name] = v._map(fn)
        return dataclasses.replace(self, **changes)
