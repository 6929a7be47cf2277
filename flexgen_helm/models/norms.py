"""The two RMSNorms of the families: Llama's (weight times the normalised input, rounded
to the input's dtype first) and Gemma's (1 + weight, all in float32), each as its
transformers reference computes it, so that half precision rounds the same way."""

from __future__ import annotations

import torch


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _normalised(x, eps).to(x.dtype)


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's: the stored weight is an offset from one (llama.cpp's converter adds the one)."""
    return (_normalised(x, eps) * (1.0 + weight.float())).to(x.dtype)
