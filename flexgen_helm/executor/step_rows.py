"""What every layer of one token step shares for one GPU batch: the rows it computes (the
sequences not finished yet), their KV-cache units, the keys each may see, the family's
per-step constants. Built once per step, so a layer does no bookkeeping of its own."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


@dataclass
class StepRows:
    rows: torch.Tensor | None  # (a,) sorted rows of the GPU batch computed at this step; None: all
    units: list[int] | None  # their cache units (row * kv_heads + head), sorted; None: all
    valid: torch.Tensor  # (units computed, t) bool on the compute device: the keys each unit may see
    positions: torch.Tensor  # (rows computed, s) on the compute device: their tokens' positions
    at: object  # family.step_constants at the rows' positions
    # units as a CPU tensor (the slots' writes: they work out rows and columns on the host, and
    # a copy on a GPU would be read back, one sync per layer and write)
    unit_index: torch.Tensor | None
    _parts: dict = field(default_factory=dict)
    _per_step: dict = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.rows is not None and len(self.rows) == 0

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The computed rows of a full-batch tensor (dim 0)."""
        return x if self.rows is None else x.index_select(0, self.rows.to(x.device))

    def put(self, full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """`full` with the computed rows replaced by `part` (rows not computed keep theirs)."""
        return part if self.rows is None else full.index_copy(0, self.rows.to(full.device), part)

    def tier_part(self, a: int, b: int) -> tuple[slice, torch.Tensor | None]:
        """For a tier holding cache units [a, b): which of the computed units live there (a
        slice: units are sorted and a tier's are contiguous) and their indices within the
        tier (None: all of the tier's units)."""
        if (a, b) not in self._parts:
            if self.units is None:
                self._parts[a, b] = (slice(a, b), None)
            else:
                i, j = bisect.bisect_left(self.units, a), bisect.bisect_left(self.units, b)
                local = None if j - i == b - a else torch.tensor(self.units[i:j]) - a
                self._parts[a, b] = (slice(i, j), local)
        return self._parts[a, b]

    def per_step(self, key, make):
        """What every layer of the step computes alike for this GPU batch (`key` names it and
        what it depends on besides the step): made by make() at the first layer that asks."""
        if key not in self._per_step:
            self._per_step[key] = make()
        return self._per_step[key]


def units_of(rows: list[int], kv_heads: int) -> list[int]:
    return [r * kv_heads + h for r in rows for h in range(kv_heads)]
