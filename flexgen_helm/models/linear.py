"""The two ways a layer's math uses a weight matrix, for plain and compressed weights alike.

A compressed weight (compression/int4.py's CompressedWeight, which the weight homes hand
out) is not a tensor: it multiplies itself, on packed bytes or dequantized as its row
count says, and looks up table rows itself (dequantizing only those rows where it can). It is recognised by not being a
tensor, so the models stay below compression in the import layers. A plain weight, and a
compressed one's dense copy, multiply as dense_linear.py says (W x^T at the decode row
counts where this machine's profile measured it faster).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexgen_helm.dense_linear import dense_linear


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    return dense_linear(x, w, bias) if isinstance(w, torch.Tensor) else w.linear(x, bias)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    return F.embedding(ids, w) if isinstance(w, torch.Tensor) else w.embedding(ids)
