"""The product of activations with a dense weight matrix, as every layer computes it: a plain
weight (models/linear.py) and a compressed weight's dense copy (compression/int4.py's
CompressedWeight) alike.

`F.linear`, except for the band of decode-sized row counts where this machine's profile
measured the other orientation faster: y^T = W x^T, the weight as the product's tall left
operand. A decode step's products stream every weight from memory for a few rows; a CPU's
GEMM partitions a tall left operand's rows over its threads and streams them once, where
`F.linear` (x W^T) took 1.1-3.9x longer at 4-128 rows on a 2-core AVX2 EPYC in float32. The
band is a band, not "up to": on a 2-core AVX-512 Xeon W x^T lost at 2 rows on every shape
measured (0.44-0.53x) and gained 1.2-2.6x at 16-48 rows, while from 64 rows it lost on
SmolLM2's shapes (0.65-1.03x) and gained at most 1.22x on OPT-1.3B's
(runs/bench/linear_orientation/band_2026-11-27.jsonl).
`flexgen-helm profile` measures where it pays (planner/hardware_profile.py), per device type
and dtype; nothing changes unprofiled. A weight stored by column (a transposed view) always
takes F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

NO_ROWS = (0, 0)
# (device type, dtype) -> (fewest, most) rows multiplied as W x^T (fewest > 1; absent: never)
FLIPPED_ROWS: dict[tuple[str, torch.dtype], tuple[int, int]] = {}


def set_flipped_rows(device_type: str, dtype: torch.dtype, rows: tuple[int, int]) -> None:
    """Products of rows[0]..rows[1] rows (both included) on `device_type` in `dtype` run as
    W x^T from now on (NO_ROWS: none); planner/hardware_profile.use_profile sets what
    `flexgen-helm profile` measured."""
    first, last = rows
    if (first, last) != NO_ROWS and not 1 < first <= last:
        raise ValueError(f"a band of row counts 1 < first <= last (or {NO_ROWS}: none), got {rows}")
    FLIPPED_ROWS[(device_type, dtype)] = (first, last)


def flips(rows: int, band: tuple[int, int]) -> bool:
    """Whether a product of `rows` rows runs as W x^T under `band` (set_flipped_rows's)."""
    first, last = band
    return band != NO_ROWS and first <= rows <= last


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), as W x^T where the profile chose it for this row count."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # a weight stored by column (a transposed view: a CPU-packed int4 weight's dense copy made
    # for a call of up to 2048 rows, compression/int4.py) is F.linear's own layout; as W x^T it
    # took 8.9x F.linear's time on the same weight at 10 rows in float32 on the AVX2 EPYC
    # (runs/bench/linear_orientation/by_column.jsonl)
    if (flips(rows, FLIPPED_ROWS.get((x.device.type, x.dtype), NO_ROWS)) and w.dtype == x.dtype and w.is_contiguous()
            and (bias is None or bias.dtype == x.dtype)):  # F.linear refuses mixed dtypes: so does this
        return flipped_linear(x, w, bias)
    return F.linear(x, w, bias)


def flipped_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) computed as (W x^T)^T: the same sums, in another order."""
    y = torch.mm(w, x.reshape(-1, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], w.shape[0])


class PackedLinear:
    """A bf16 weight matrix that lives in a CPU's memory for the whole run, held in oneDNN's
    blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, once, at placement) and
    multiplied there (`_linear_pointwise`). F.linear hands a bf16 product to the same oneDNN
    kernel but reorders the weight into that layout at every call: at decode's few rows that
    copy is as much memory traffic as the product. On a 2-core AVX512-BF16 EPYC, alone: 1.6-1.95x
    F.linear's speed at 1-4 rows, 1.4-1.5x at 16, 1.2x at 64, 1.03-1.06x at 512-2048, every
    output bit for bit F.linear's (runs/bench/packed_linear). Not a tensor: models/linear.py
    hands it the product, as it does a compressed weight."""

    def __init__(self, weight: torch.Tensor):
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.nbytes = weight.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.shape[1]), self.packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], self.shape[0])


def packs_linear_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights kept in `device`'s memory for products in `dtype` are held as
    PackedLinear: bf16 on a CPU whose oneDNN computes bf16 natively. FLEXGEN_HELM_PACKED_WEIGHTS
    =off keeps them plain (an A/B's other side); any value but on/off is refused."""
    setting = os.environ.get("FLEXGEN_HELM_PACKED_WEIGHTS", "on")
    if setting not in ("on", "off"):
        raise ValueError(f"FLEXGEN_HELM_PACKED_WEIGHTS={setting!r}: use 'on' (the default) or 'off'")
    return (setting == "on" and torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
