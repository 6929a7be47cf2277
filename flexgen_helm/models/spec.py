"""The named weight tensors of a model, grouped into the layers the schedule walks."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The key of a block's attention sinks (gpt-oss: a logit per query head that joins each
# attention softmax's denominator), which the executor's attention reads from the block's weights
SINKS = "attn.sinks"


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor of a layer.

    `key` is the name the layer's math uses; `store_name` is the tensor's name in the
    weight store (a tied weight has the store name of the tensor it shares).
    """

    key: str
    store_name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class LayerSpec:
    """A step of the schedule: the input embedding, one transformer block, or the head."""

    name: str
    kind: str  # "embed", "block" or "head"
    index: int  # block index; -1 for embed and head
    tensors: tuple[TensorSpec, ...]


def is_lookup_table(layer: LayerSpec, key: str) -> bool:
    """Embedding tables are gathered from (models/linear.embedding), not multiplied with."""
    return layer.kind == "embed" and key.endswith(("tokens.weight", "positions.weight"))


def tensor(layer: str, key: str, *shape: int, tied_to: str | None = None) -> TensorSpec:
    return TensorSpec(key=key, store_name=tied_to or f"{layer}.{key}", shape=tuple(shape))


def all_store_tensors(layers: list[LayerSpec]) -> list[TensorSpec]:
    """Every tensor the store must hold, once each, in schedule order."""
    seen, out = set(), []
    for layer in layers:
        for t in layer.tensors:
            if t.store_name not in seen:
                seen.add(t.store_name)
                out.append(t)
    return out
