"""Random weights of the right shapes, for benchmarking the engine on models we do not have.

Each tensor is drawn from its own generator seeded by (seed, store name), so any one
tensor can be made alone, in any order, and the model is never whole in RAM. Values
are small (std 0.02, norms 1, biases 0) so fp16 activations stay finite through many layers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from flexgen_helm.errors import WeightStoreError
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.tokenizer import byte_standin_tokenizer
from flexgen_helm.weights.source import WeightSource

STD = 0.02


def tensor_seed(seed: int, store_name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{store_name}".encode()).digest()[:8], "little")


class DummyWeights(WeightSource):
    def __init__(self, config: ModelConfig, seed: int = 0, tokenizer_from: WeightSource | None = None):
        """`tokenizer_from`: a real source whose tokenizer to use; else a byte-level stand-in."""
        self.config = config
        self.seed = seed
        self.tokenizer_from = tokenizer_from
        self._shapes = {s.store_name: s.shape for s in self.tensor_specs()}

    @property
    def identity(self) -> str:
        return f"dummy:seed={self.seed}"

    def read(self, store_name: str) -> torch.Tensor:
        shape = self._shapes.get(store_name)
        if shape is None:
            raise WeightStoreError(f"{self.config.name} has no tensor {store_name!r}")
        if store_name.endswith("norm.weight"):
            return torch.ones(shape)
        if store_name.endswith(".bias"):
            return torch.zeros(shape)
        g = torch.Generator().manual_seed(tensor_seed(self.seed, store_name))
        return torch.randn(shape, generator=g).mul_(STD)

    def load_tokenizer(self, cache_dir: Path):
        if self.tokenizer_from is not None:
            return self.tokenizer_from.load_tokenizer(cache_dir)
        return byte_standin_tokenizer(self.config)
