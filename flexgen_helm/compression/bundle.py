"""What a compressed tensor's stored parts do together: move, pin, copy and weigh as one."""

from __future__ import annotations

import dataclasses

import torch


class TensorBundle:
    """Mixin for a dataclass whose tensor fields are the stored parts of one tensor (codes,
    scales, ...): every tensor field travels together, the other fields (shape, group
    size, ...) stay as they are."""

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors, in field order."""
        return tuple(v for v in (getattr(self, f.name) for f in dataclasses.fields(self))
                     if isinstance(v, torch.Tensor))

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def to(self, device, non_blocking: bool = False):
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self):
        return self._map(lambda t: t.pin_memory())

    def clone(self):
        return self._map(lambda t: t.clone())

    def _map(self, fn):
        return dataclasses.replace(self, **{f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})
