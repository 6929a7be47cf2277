"""A Linear layer whose weight stays compressed: dequantize a block of output rows at a
time, so a huge matrix never exists in full precision at once (matters on the CPU, where
a dequantized fp32 copy of a big weight could cost gigabytes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexgen_helm.compression.quantize import QuantizedTensor, dequantize

DEFAULT_CHUNK_BYTES = 64 << 20  # dequantized bytes per block of rows


def dequantize_linear(
    x: torch.Tensor,
    q: QuantizedTensor,
    bias: torch.Tensor | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """F.linear(x, dequantize(q, x.dtype), bias) for a compressed (out, in) weight, computed
    over blocks of output rows whose dequantized size stays under max_chunk_bytes."""
    if len(q.shape) != 2:
        raise ValueError(f"dequantize_linear takes a 2-D (out, in) weight, got shape {q.shape}")
    n_out, n_in = q.shape
    row_bytes = n_in * x.element_size()
    rows = max(1, max_chunk_bytes // row_bytes)
    if q.group_dim == 0:  # blocks of rows must be whole groups to slice without dequantizing
        rows = max(q.group_size, rows // q.group_size * q.group_size)
    if rows >= n_out:
        return F.linear(x, dequantize(q, x.dtype), bias)
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    for start in range(0, n_out, rows):
        n = min(rows, n_out - start)
        w = dequantize(q.narrow(0, start, n), x.dtype)
        b = None if bias is None else bias[start : start + n]
        out[..., start : start + n] = F.linear(x, w, b)
    return out
