"""A weight compression resolved tensor by tensor: where a weight source holds its own codes
(policy.SOURCE_CODE_METHODS: a GGUF file's quantized tensors), each such weight keeps them
on its own grid (its width, groups of 32 along the input dim); the rest take the setting's
grid, re-quantized by min/max. Everything that sizes, places, stores or packs a weight asks
`tensor_compression` for that weight's setting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from flexgen_helm.policy.policy import PER_CHANNEL, SOURCE_CODE_METHODS, Compression

SOURCE_GROUP_SIZE = 32  # every GGUF format whose codes are kept groups 32 input weights
SOURCE_GROUP_DIM = 1


@dataclass(frozen=True)
class WeightGrids:
    """`setting` (a SOURCE_CODE_METHODS compression) resolved for one model's source."""

    setting: Compression
    kept: tuple[tuple[str, int], ...]  # (store name, code width) of the weights whose source codes are kept

    @cached_property
    def _bits(self) -> dict[str, int]:
        return dict(self.kept)

    def of(self, name: str) -> Compression:
        bits = self._bits.get(name)
        if bits is None:  # re-quantized onto the setting's grid, as FlexGen does
            return dataclasses.replace(self.setting, method="rtn")
        return dataclasses.replace(self.setting, bits=bits, group_size=SOURCE_GROUP_SIZE,
                                   group_dim=SOURCE_GROUP_DIM)


WeightCompression = Compression | WeightGrids | None


def tensor_compression(compression: WeightCompression, name: str, shape) -> Compression | None:
    """The setting weight `name` of `shape` is stored under: a PER_CHANNEL group size becomes
    the weight's input size (one group per row). A SOURCE_CODE_METHODS setting not yet
    resolved for a source (the planner's view, before the file is opened) stands for every
    weight as it is: its bits and group size are those of the grid it mostly holds."""
    cfg = compression.of(name) if isinstance(compression, WeightGrids) else compression
    if cfg is not None and cfg.group_size == PER_CHANNEL and len(tuple(shape)) >= 2:
        return dataclasses.replace(cfg, group_size=tuple(shape)[-1], group_dim=SOURCE_GROUP_DIM)
    return cfg


def setting_of(compression: WeightCompression) -> Compression | None:
    """The deployment's setting behind a resolved compression."""
    return compression.setting if isinstance(compression, WeightGrids) else compression


def takes_source_codes(cfg: Compression | None) -> bool:
    return cfg is not None and cfg.method in SOURCE_CODE_METHODS
