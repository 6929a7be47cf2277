"""How the engine stores a tensor under a policy: plain, or quantized along one dimension.

One place answers, for weights and KV cache alike, "which dimension forms the groups",
"where may a row range be cut" and "how many bytes does it take", so that placement,
homes, budgets and reports all agree on the compressed sizes."""

from __future__ import annotations

import math

import torch

from flexgen_helm.compression.quantize import QuantizedTensor, dequantize, quantize, should_compress, weight_group_dim
from flexgen_helm.policy.policy import Compression

Stored = torch.Tensor | QuantizedTensor


def weight_groups(cfg: Compression | None, shape) -> int | None:
    """The (non-negative) dimension a weight's groups run along, or None when the weight
    stays plain (no weight compression, or a 1-D bias / norm)."""
    if cfg is None or not should_compress(shape):
        return None
    return weight_group_dim(cfg, shape) % len(tuple(shape))


def row_alignment(cfg: Compression | None, shape) -> int:
    """Rows a placement cut must be a multiple of: a group when groups run along the rows
    (so every tier holds whole groups), else one row."""
    return cfg.group_size if weight_groups(cfg, shape) == 0 else 1


def encode(t: torch.Tensor, cfg: Compression | None, group_dim: int | None) -> Stored:
    return t if group_dim is None else quantize(t, cfg, group_dim)


def stored_nbytes(shape, dtype: torch.dtype, cfg: Compression | None, group_dim: int | None) -> int:
    """Bytes a tensor of `shape` takes as stored (codes, scales and mins when quantized)."""
    if group_dim is None:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return QuantizedTensor.empty(shape, dtype, cfg, group_dim, device="meta").nbytes


def dense(x: Stored, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A stored tensor ready for compute, dequantized where it now lives."""
    return dequantize(x, dtype) if isinstance(x, QuantizedTensor) else x
