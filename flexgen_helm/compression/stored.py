"""How the engine stores a tensor under a policy: plain, or quantized along one dimension.

One place answers, for weights and KV cache alike, "which dimension forms the groups",
"where may a row range be cut" and "how many bytes does it take", so that placement,
homes, budgets and reports all agree on the compressed sizes, and which weights are kept
in an int4 kernel's packed layout (compression/int4.py) for the device that computes."""

from __future__ import annotations

import math

import torch

from flexgen_helm.compression import int8
from flexgen_helm.compression.grids import WeightCompression, setting_of, tensor_compression
from flexgen_helm.compression.int4 import (
    ROW_BLOCK,
    PackedInt4,
    dequantize_packed,
    device_refusal,
    layout_refusal,
    log_slow_path_once,
    pack_int4,
)
from flexgen_helm.compression.quantize import (
    QuantizedTensor,
    Scratch,
    dequantize,
    dequantize_into,
    quantize,
    should_compress,
    weight_group_dim,
)
from flexgen_helm.errors import PolicyError
from flexgen_helm.policy.policy import Compression

Stored = torch.Tensor | QuantizedTensor | PackedInt4 | int8.PackedInt8


def quantized_once(compression: WeightCompression) -> bool:
    """Whether a method costs enough to quantize once, at conversion, into the compressed
    store that every tier then loads (anything but RTN, which is cheaper to redo at load
    than to read back; a source's own codes are read from it once, there)."""
    return setting_of(compression).method != "rtn"


def weight_groups(cfg: Compression | None, shape) -> int | None:
    """The (non-negative) dimension a weight's groups run along, or None when the weight
    stays plain (no weight compression, or a 1-D bias / norm)."""
    if cfg is None or not should_compress(shape):
        return None
    return weight_group_dim(cfg, shape) % len(tuple(shape))


def row_alignment(cfg: Compression | None, shape) -> int:
    """Rows a placement cut must be a multiple of: a group when groups run along the rows
    (so every tier holds whole groups); a packed block when the weight can take an int4
    kernel's layout (so every tier's rows are a packed matrix of their own, whichever
    device computes); else one row."""
    gd = weight_groups(cfg, shape)
    if gd == 0:
        return cfg.group_size
    return ROW_BLOCK if gd is not None and layout_refusal(cfg, shape, gd) is None else 1


def check_weight_compression(compression: WeightCompression, specs) -> None:
    """Refuse, before any weight is read, settings no weight can be quantized under. specs:
    (store name, shape) of each weight."""
    if compression is None:
        return
    setting_of(compression).validate("compress_weight")
    for name, shape in specs:
        cfg = tensor_compression(compression, name, shape)
        gd = weight_groups(cfg, shape)
        if gd is not None and shape[gd] % cfg.group_size:
            raise PolicyError(f"compress_weight: group size {cfg.group_size} does not divide dim {gd} "
                              f"(size {shape[gd]}) of a {tuple(shape)} weight; pick a divisor of it")


def weight_layout(cfg: Compression | None, shape, dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel layout a weight is stored in when `device` computes in `dtype`: the int4
    kernel's ("cpu" or "cuda"), the int8 kernel's ("int8", 8 bits, one group per output
    channel: compression/int8.py), or None for the group layout (QuantizedTensor) - logging
    once why a compressed weight cannot take a kernel."""
    gd = weight_groups(cfg, shape)
    if gd is None:
        return None
    if cfg.bits == int8.KERNEL_BITS:
        reason = int8.layout_refusal(cfg, shape, gd) or int8.device_refusal(dtype, device)
        if reason is None:
            return int8.LAYOUT
    else:
        reason = layout_refusal(cfg, shape, gd) or device_refusal(dtype, device)
    if reason is not None:
        log_slow_path_once(reason)
        return None
    return device.type


def encode(t: torch.Tensor, cfg: Compression | None, group_dim: int | None, layout: str | None = None) -> Stored:
    """`t` as stored: plain, quantized, or quantized and packed for `layout`'s kernel (on
    the CPU, whatever device packed it)."""
    if group_dim is None:
        return t
    return in_layout(quantize(t, cfg, group_dim), layout)


def in_layout(q: QuantizedTensor, layout: str | None, dtype: torch.dtype | None = None) -> Stored:
    """A quantized weight as stored: as is, or packed for `layout`'s kernel (on the CPU; the
    int8 kernel's scales in `dtype`, the compute dtype: default the weight's own)."""
    if layout is None:
        return q
    if layout == int8.LAYOUT:
        return int8.pack_int8(q, dtype or q.dtype)
    return pack_int4(q, torch.device(layout)).to("cpu")


def stored_nbytes(shape, dtype: torch.dtype, cfg: Compression | None, group_dim: int | None) -> int:
    """Bytes a tensor of `shape` takes as stored (codes, scales and mins when quantized)."""
    if group_dim is None:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return QuantizedTensor.empty(shape, dtype, cfg, group_dim, device="meta").nbytes


def dense(x: Stored, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A stored tensor ready for compute, dequantized where it now lives."""
    if isinstance(x, PackedInt4):
        return dequantize_packed(x, dtype or torch.bfloat16)
    if isinstance(x, int8.PackedInt8):
        return int8.dequantize_int8(x, dtype or x.scales.dtype)
    return dequantize(x, dtype) if isinstance(x, QuantizedTensor) else x


def dense_into(x: torch.Tensor | QuantizedTensor, out: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """dense(x, out.dtype) written into `out` (x's shape, any strides): a plain tensor copied
    (from any device), a quantized one dequantized where it lives (see dequantize_into)."""
    if isinstance(x, QuantizedTensor):
        return dequantize_into(x, out, scratch)
    return out.copy_(x, non_blocking=True)
