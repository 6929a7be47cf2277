"""MXFP4, the format OpenAI published gpt-oss's experts in (OCP Microscaling FP4): each
row's values in blocks of 32, each value a 4-bit float (e2m1: sign, two exponent bits, one
mantissa bit), two to a byte (the low nibble first), each block with one shared power of
two (a uint8 exponent biased by 127). A value is its e2m1 number times 2 ** (scale - 127),
which float32 holds exactly (bfloat16 too, but for the far subnormal scales): dequantized
once, at conversion, into the store's dtype; the store then places and compresses the
experts like any weight."""

from __future__ import annotations

import torch

# the 16 e2m1 codes' values: the sign bit (8) last
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks (..., groups, 16) uint8 and scales (..., groups) uint8 -> (..., groups * 32) float32."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks of shape {list(blocks.shape)} do not match scales of shape "
                         f"{list(scales.shape)} (blocks: the scales' shape and 16 bytes)")
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    out = torch.empty(*codes.shape[:-1], 32, dtype=torch.float32)
    out[..., 0::2] = values[(codes & 0x0F).long()]
    out[..., 1::2] = values[(codes >> 4).long()]
    exponents = scales.to(torch.int32)[..., None] - SCALE_BIAS
    return torch.ldexp(out, exponents).flatten(-2)
