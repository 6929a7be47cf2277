"""Splitting a projection into attention heads."""

from __future__ import annotations

import torch


def split_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(b, s, n * d) -> (b, n, s, d)."""
    b, s, _ = x.shape
    return x.reshape(b, s, n, -1).transpose(1, 2)
