"""What every weight reader offers the converter: a config and the tensors, one at a time.

Readers never hold more than one tensor: a model may be far larger than RAM, and the
converter's peak memory must stay near the size of its largest tensor.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from flexgen_helm.errors import WeightStoreError
from flexgen_helm.models import family_of
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.spec import TensorSpec, all_store_tensors

_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"experts\.(\d+)\.")


def rename(store_name: str, table: dict[str, str]) -> str:
    """Translate a store name through a table of module names.

    Table keys are store module names with `{i}` for the block index
    (`layers.{i}.q_proj`), and `{e}` for an expert's index (`layers.{i}.experts.{e}.up_proj`);
    values are the foreign names, also with `{i}` and `{e}`. The parameter suffix
    (`.weight`, `.bias`) carries over unchanged.
    """
    module, param = store_name.rsplit(".", 1)
    block = _BLOCK.fullmatch(module)
    key = f"layers.{{i}}.{block[2]}" if block else module
    expert = _EXPERT.search(key)
    if expert:
        key = key[:expert.start()] + "experts.{e}." + key[expert.end():]
    if key not in table:
        raise WeightStoreError(f"no source name known for tensor {store_name!r}")
    return table[key].format(i=block[1] if block else "", e=expert[1] if expert else "") + "." + param


class WeightSource(ABC):
    """A model's weights in some external format, addressed by store names."""

    config: ModelConfig

    @property
    @abstractmethod
    def identity(self) -> str:
        """A string that changes whenever the weights do (path, size, mtime, seed)."""

    @abstractmethod
    def read(self, store_name: str) -> torch.Tensor:
        """One tensor, by its store name, in torch (out, in) orientation, any float dtype."""

    @abstractmethod
    def load_tokenizer(self, cache_dir: Path):
        """The model's tokenizer as a transformers PreTrainedTokenizerFast."""

    def tensor_specs(self) -> list[TensorSpec]:
        return all_store_tensors(family_of(self.config).layer_specs(self.config))

    def release(self) -> None:
        """Let go of the files reading keeps open, once the engine's store is written: a
        memory-mapped file's pages that a conversion read count in the process's RSS for as
        long as it stays mapped (a 2 GiB GGUF's, a whole run long: runs/moe/gathered_prefill_memory).
        A later read opens them again."""
        return  # a source that maps no file (dummy weights) holds nothing

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(store_name, tensor) for the named tensors (all by default), one at a time,
        each checked against the shape the architecture expects."""
        wanted = None if names is None else set(names)
        for spec in self.tensor_specs():
            if wanted is not None and spec.store_name not in wanted:
                continue
            t = self.read(spec.store_name)
            if tuple(t.shape) != spec.shape:
                raise WeightStoreError(
                    f"{self.config.name}: tensor {spec.store_name} has shape {list(t.shape)}, expected "
                    f"{list(spec.shape)} for {self.config.name}; the checkpoint does not match its config"
                )
            yield spec.store_name, t
