"""A GGUF tensor's own quantization codes as the engine's group-wise grid, without
re-quantizing: each llama.cpp block format whose every group of 32 consecutive input
weights is w = min + code * scale (codes unsigned, `bits` wide) maps onto a QuantizedTensor
grouped by 32 along dim 1 (compression/quantize.py), which the int4 kernels or the group
layout then take as they are.

| type | bytes per block | per group of 32: scale, min | codes |
| --- | --- | --- | --- |
| Q4_0 | 18 / 32 | d, -8 d | 4-bit |
| Q4_1 | 20 / 32 | d, m | 4-bit |
| Q5_0 | 22 / 32 | d, -16 d | 5-bit (a 4-bit nibble and a high bit) |
| Q5_1 | 24 / 32 | d, m | 5-bit |
| Q8_0 | 34 / 32 | d, -128 d | 8-bit (the file's int8 + 128) |
| Q4_K | 144 / 256 | d sc_s, -dmin m_s (6-bit sc_s, m_s per sub-block of 32) | 4-bit |
| Q5_K | 176 / 256 | as Q4_K | 5-bit |

Why this is exact in float32: d, m, dmin are float16 and sc_s, m_s 6-bit integers, so every
scale, minimum and code * scale here is a float32 without rounding, and min + code * scale
(dequantize's order) then rounds once, as gguf's own dequantization (d * q + m, or
d * sc * q - dmin * m) does: the two agree bit for bit (tests/test_gguf_codes.py).
Scales and minimums are kept in float16 where each is one (Q4_0/1, Q5_0/1, Q8_0 with |128 d|
in range), else in float32 (the K-quants' d * sc has up to 17 significant bits).
Other types (F16, BF16, F32, Q6_K's 16-element blocks with signed scales, the IQ types) have
no such grid: `code_bits` says None and why.
"""

from __future__ import annotations

import numpy as np
import torch

from flexgen_helm.compression.quantize import QuantizedTensor, pack

SOURCE_GROUP = 32  # every format above groups 32 consecutive input weights
_K_BLOCK = 256  # a K-quant super-block: 8 groups of 32
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}


def code_bits(type_name: str) -> int | None:
    """The width of the codes a GGUF tensor type holds on an affine grid of groups of 32, or
    None when it holds none (float types, Q6_K, IQ types, ...)."""
    return _BITS.get(type_name)


def held_types() -> tuple[str, ...]:
    return tuple(_BITS)


def codes_fit(type_name: str, shape) -> bool:
    """Whether a tensor of this type and shape is an (out, in) weight of whole blocks per row."""
    block = _K_BLOCK if type_name.endswith("_K") else SOURCE_GROUP
    return len(tuple(shape)) == 2 and shape[1] % block == 0


def read_codes(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """The (out, in) weight stored as `raw` (the file's bytes of type `type_name`, rows of
    blocks) as a QuantizedTensor of its own codes, grouped by 32 along dim 1."""
    bits = code_bits(type_name)
    if bits is None:
        raise ValueError(f"GGUF type {type_name} holds no codes on an affine grid of groups of 32 "
                         f"(held: {', '.join(_BITS)})")
    if not codes_fit(type_name, shape):
        raise ValueError(f"a {tuple(shape)} {type_name} tensor is not an (out, in) weight of whole blocks per row")
    n, k = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    codes, scale, mn = _DECODERS[type_name](blocks)
    groups = (n, k // SOURCE_GROUP)
    codes = torch.from_numpy(codes).view(*groups, SOURCE_GROUP)
    scale, mn = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).view(groups) for a in (scale, mn))
    dtype = torch.float16 if _fits_half(scale) and _fits_half(mn) else torch.float32
    return QuantizedTensor(data=pack(codes, bits).contiguous(), scale=scale.to(dtype), min=mn.to(dtype),
                           shape=(n, k), dtype=dtype, bits=bits, group_size=SOURCE_GROUP, group_dim=1)


def _fits_half(x: torch.Tensor) -> bool:
    return bool(torch.equal(x.to(torch.float16).float(), x))


def _half(b: np.ndarray) -> np.ndarray:
    """Two bytes per row -> float32 (exactly: a float16 widened)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def _split(blocks: np.ndarray, size: int, *widths: int) -> list[np.ndarray]:
    rows = blocks.reshape(-1, size)
    edges = np.cumsum(widths)[:-1]
    return np.hsplit(rows, edges)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per group -> 32 codes: element j in byte j's low nibble, j + 16 in its high one."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """A Q5_0/Q5_1 group's 4 bytes of high bits (bit j: element j's fifth bit) -> 0 or 16."""
    word = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(blocks):
    d, qs = _split(blocks, 18, 2, 16)
    d = _half(d)
    return _nibbles(qs), d, -8 * d


def _q4_1(blocks):
    d, m, qs = _split(blocks, 20, 2, 2, 16)
    return _nibbles(qs), _half(d), _half(m)


def _q5_0(blocks):
    d, qh, qs = _split(blocks, 22, 2, 4, 16)
    d = _half(d)
    return _nibbles(qs) | _high_bits(qh), d, -16 * d


def _q5_1(blocks):
    d, m, qh, qs = _split(blocks, 24, 2, 2, 4, 16)
    return _nibbles(qs) | _high_bits(qh), _half(d), _half(m)


def _q8_0(blocks):
    d, x = _split(blocks, 34, 2, 32)
    d = _half(d)
    return (x.view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d


def _k_scales(blocks: np.ndarray, size: int, tail: int):
    """A K-quant super-block's 8 groups: scale d * sc, minimum -dmin * m (gguf's own unpacking
    of the 6-bit sc and m), and the rest of the block's bytes."""
    from gguf.quants import Q4_K

    d, dmin, packed, rest = _split(blocks, size, 2, 2, 12, tail)
    sc, m = Q4_K.get_scale_min(packed)
    scale = _half(d)[:, None] * sc.astype(np.float32)
    mn = -(_half(dmin)[:, None] * m.astype(np.float32))
    return scale.reshape(-1), mn.reshape(-1), rest


def _k_low(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 groups of 32 4-bit codes: bytes [32 c, 32 c + 32) hold group 2 c in
    their low nibbles and group 2 c + 1 in their high ones."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _q4_k(blocks):
    scale, mn, qs = _k_scales(blocks, 144, 128)
    return _k_low(qs).reshape(-1, 32), scale, mn


def _q5_k(blocks):
    scale, mn, rest = _k_scales(blocks, 176, 160)
    qh, qs = np.hsplit(rest, [32])
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # bit s: group s
    return (_k_low(qs) | high << 4).reshape(-1, 32), scale, mn


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k}
