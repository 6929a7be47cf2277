"""The two RMSNorms of the families: Llama's (weight times the normalised input, rounded
to the input's dtype first) and Gemma's (1 + weight, all in float32), each as its
transformers reference computes it, so that half precision rounds the same way."""

from __future__ import annotations

from typing import Callable

import torch

from flexgen_helm.models import cache_pieces


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _by_pieces(x: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """norm(x), a piece of rows at a time where x is large (models/cache_pieces.py)."""
    if not cache_pieces.pieced(x.numel(), x.device.type) or not x.is_contiguous():
        return norm(x)
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, cache_pieces.PIECE_ELEMENTS // x.shape[-1])
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
