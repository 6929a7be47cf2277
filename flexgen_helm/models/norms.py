"""The two RMSNorms of the families: Llama's (weight times the normalised input, rounded
to the input's dtype first) and Gemma's (1 + weight, all in float32), each as its
transformers reference computes it, so that half precision rounds the same way."""

from __future__ import annotations

from typing import Callable

import torch

# A large input's rows are normalised a piece of NORM_PIECE_ELEMENTS at a time, so that its
# float32 copies stay in the core's cache instead of streaming through memory four times: an
# 8192 x 2048 bf16 input took 12.6 ms whole, 6.1 ms in pieces of 512 rows (2.1x; float32 1.3x;
# 4096 x 2048: 1.9x / 1.07x; 2-core AVX512-BF16 EPYC, alone: runs/bench/norm_pieces). Inputs of
# up to a few M elements fit the cache whole, where pieces would only add calls. Each row is
# its own sum, so the bits are the same.
NORM_PIECE_ELEMENTS = 1 << 20
NORM_PIECED_FROM = 1 << 22


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _by_pieces(x: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if x.numel() <= NORM_PIECED_FROM or x.device.type != "cpu" or not x.is_contiguous():  # (a CPU's cache)
        return norm(x)
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, NORM_PIECE_ELEMENTS // x.shape[-1])
    first = norm(rows[:step])
    out = torch.empty(rows.shape, dtype=first.dtype, device=x.device)
    out[:step] = first
    for start in range(step, rows.shape[0], step):
        out[start:start + step] = norm(rows[start:start + step])
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _by_pieces(x, lambda rows: weight * _normalised(rows, eps).to(x.dtype))


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's: the stored weight is an offset from one (llama.cpp's converter adds the one)."""
    return _by_pieces(x, lambda rows: (_normalised(rows, eps) * (1.0 + weight.float())).to(x.dtype))
