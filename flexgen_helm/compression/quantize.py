"""Group-wise asymmetric min/max quantization (FlexGen, Section 5).

A tensor is cut into groups of `group_size` consecutive elements along `group_dim`; each
group keeps its min and a scale = (max - min) / (2^bits - 1), and each element becomes the
integer code round((x - min) / scale) in [0, 2^bits - 1]. Dequantization is min + code * scale.

Storage layout of a `QuantizedTensor` for an input of shape S with n = S[group_dim]:

- ng = ceil(n / group_size) groups along group_dim; the last one is padded (by repeating
  the last real element, so padding never widens a group's range) and the padding is
  dropped again by `dequantize`.
- `scale` and `min`: shape S with S[group_dim] replaced by ng, in the *input's* dtype
  (fp16 -> fp16, bf16 -> bf16, fp32 -> fp32). Why the input dtype rather than always fp16:
  a group's min is one of its own elements, so it is stored exactly; and fp16 cannot hold
  the scales of fp32/bf16 tensors with large or tiny ranges. The scale is rounded *up* to
  the storage dtype so that [min, min + (2^bits-1) * scale] still covers the whole group
  and the error bound |x - x_hat| <= scale / 2 holds for every element.
- `data` (uint8): shape S with S[group_dim] replaced by ng, plus a trailing dimension of
  bytes_per_group = ceil(group_size * bits / 8). Each group's codes are one little-endian
  bitstream: code j occupies bits [j*bits, (j+1)*bits) counted from bit 0 of byte 0. For
  bits in {1, 2, 4, 8} that is plain dense packing (8 / bits codes per byte, code 0 in the
  low bits); for 3, 5, 6, 7 codes straddle byte boundaries. No width is stored wider than
  `bits`; the only waste is the < 8 bits rounding a group up to whole bytes (none when
  group_size is a multiple of 8, e.g. the paper's 64).

Keeping the groups as a real tensor dimension in place of group_dim means that slicing any
other dimension (rows of a weight, tokens of the KV cache) is plain tensor slicing; see
`QuantizedTensor.narrow`.

Conventions for which dimension forms the groups (FlexGen's reference code):
- Weights: torch Linear weights are (out, in); groups run along dim 1, i.e. `group_size`
  consecutive input channels of one output row share a min/scale. That is the grouping
  every fast int4 kernel takes (compression/int4.py); FlexGen's reference code grouped
  along dim 0 (output channels), which `group_dim=0` still gives.
- KV cache, our layout (max_len, batch * kv_heads, head_dim): groups run along head_dim
  (dim 2). Every token's row is quantized on its own, so the cache can be appended to one
  token at a time without touching earlier groups. (KIVI's grouping, keys along the tokens
  of each channel: compression/kivi.py.)
- Only tensors with >= 2 dimensions are compressed; biases and norm weights stay as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from flexgen_helm.compression.bundle import TensorBundle
from flexgen_helm.compression.hqq import fit_scale_min
from flexgen_helm.policy.policy import CALIBRATED_METHODS, PER_CHANNEL, SOURCE_CODE_METHODS, Compression

WEIGHT_GROUP_DIM = 1  # torch Linear (out, in): consecutive input channels, as the int4 kernels take
CACHE_GROUP_DIM = 2  # KV cache (max_len, batch * kv_heads, head_dim): the head dim

# Elements per block of rows that quantize and dequantize work on: bounds their float32
# working copies (a few of this size, 64 MiB each). Smaller blocks measured slower on the
# CPU (more, smaller ops) without saving anything that matters; a layer's projections of a
# ~1B model fit in one block, and a big embedding or a 175B model's MLP takes several.
CHUNK_ELEMENTS = 1 << 24
# hqq's block of rows: its ~6 float32 working copies stay at 16 MiB each. Measured on one
# 8192 x 2048 weight (shared 2-core machine): 2^18 took twice the wall time of 2^24, 2^20 1.3x.
FIT_CHUNK_ELEMENTS = 1 << 22
# nibbles() relies on an int16's low byte coming first in memory
LITTLE_ENDIAN = sys.byteorder == "little"
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # float itemsize -> same-size int


def should_compress(shape) -> bool:
    """FlexGen compresses only weights with >= 2 dimensions (not biases, not norms)."""
    return len(tuple(shape)) >= 2


def default_weight_group_dim(shape) -> int:
    """Group dimension of a weight: dim 1 (input channels of a Linear (out, in) weight)."""
    if not should_compress(shape):
        raise ValueError(f"a weight of shape {tuple(shape)} is not compressed (only >= 2-D weights are)")
    return WEIGHT_GROUP_DIM


def default_cache_group_dim() -> int:
    """Group dimension of the KV cache (max_len, units, head_dim): head_dim, dim 2."""
    return CACHE_GROUP_DIM


def weight_group_dim(cfg: Compression, shape) -> int:
    """The policy's group_dim if it names one, else the default for weights (dim 1)."""
    return default_weight_group_dim(shape) if cfg.group_dim is None else cfg.group_dim


def cache_group_dim(cfg: Compression) -> int:
    """The policy's group_dim if it names one, else the paper's default for the KV cache."""
    return default_cache_group_dim() if cfg.group_dim is None else cfg.group_dim


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors elementwise makes no sense here
class QuantizedTensor(TensorBundle):
    """A compressed tensor: packed codes plus per-group scale and min (layout: module doc).
    Its parts (TensorBundle), in order: codes, scales, mins."""

    data: torch.Tensor  # uint8, group-dim size ng, trailing bytes_per_group
    scale: torch.Tensor  # `dtype`, shape[group_dim] = ng
    min: torch.Tensor  # `dtype`, same shape as scale
    shape: tuple  # original shape
    dtype: torch.dtype  # original dtype (also that of scale and min)
    bits: int
    group_size: int
    group_dim: int  # non-negative

    @classmethod
    def empty(cls, shape, dtype: torch.dtype, cfg: Compression, group_dim: int, device="cpu",
              pin_memory: bool = False) -> "QuantizedTensor":
        """Uninitialised storage for a tensor of `shape` (e.g. a KV cache to fill row by row;
        on the "meta" device it only tells what the compressed form would weigh)."""
        shape = tuple(shape)
        gd = group_dim % len(shape)
        grouped = list(shape)
        grouped[gd] = -(-shape[gd] // cfg.group_size)
        kw = dict(device=device, pin_memory=pin_memory)
        return cls(
            data=torch.empty(*grouped, _bytes_per_group(cfg.group_size, cfg.bits), dtype=torch.uint8, **kw),
            scale=torch.empty(grouped, dtype=dtype, **kw),
            min=torch.empty(grouped, dtype=dtype, **kw),
            shape=shape, dtype=dtype, bits=cfg.bits, group_size=cfg.group_size, group_dim=gd,
        )

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        """The compressed form of `dequantize(self).narrow(dim, start, length)`, without
        dequantizing: views into the same storage. Along group_dim the slice must fall
        on group boundaries (start a multiple of group_size; end too, or the tensor's end)."""
        dim = dim % len(self.shape)
        n = self.shape[dim]
        if not (0 <= start and length >= 0 and start + length <= n):
            raise IndexError(f"narrow({dim}, {start}, {length}) is out of range for size {n}")
        new_shape = list(self.shape)
        new_shape[dim] = length
        if dim != self.group_dim:
            g0, gl = start, length
        else:
            g = self.group_size
            if start % g or (length % g and start + length != n):
                raise ValueError(f"narrow along the group dim must align to groups of {g}: "
                                 f"got start {start}, length {length}")
            g0, gl = start // g, -(-length // g)
        return dataclasses.replace(
            self,
            data=self.data.narrow(dim, g0, gl),
            scale=self.scale.narrow(dim, g0, gl),
            min=self.min.narrow(dim, g0, gl),
            shape=tuple(new_shape),
        )


def _bytes_per_group(group_size: int, bits: int) -> int:
    return -(-group_size * bits // 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2^bits) along the last dim into a little-endian bitstream:
    (..., G) -> (..., ceil(G * bits / 8)) uint8."""
    G = codes.shape[-1]
    nbytes = _bytes_per_group(G, bits)
    codes = codes.to(torch.uint8)
    if 8 % bits == 0:  # fast path: whole codes per byte; same bytes as the bitstream below
        k = 8 // bits
        if nbytes * k != G:
            codes = torch.nn.functional.pad(codes, (0, nbytes * k - G))
        # code j of a byte ORed in at bit j * bits (a shift-and-sum over a last dim of k
        # measured 3.6x slower: a KV cache's 4-bit groups are packed at every write)
        packed = codes[..., 0::k].clone(memory_format=torch.contiguous_format)
        for j in range(1, k):
            packed.bitwise_or_(codes[..., j::k] << j * bits)
        return packed
    bit_idx = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = ((codes.unsqueeze(-1) >> bit_idx) & 1).flatten(-2)  # (..., G * bits) of 0/1
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - G * bits))
    byte_bits = torch.arange(8, dtype=torch.uint8, device=codes.device)
    return (stream.unflatten(-1, (nbytes, 8)) << byte_bits).sum(-1, dtype=torch.uint8)


def nibbles(packed: torch.Tensor, work: torch.Tensor | None = None) -> torch.Tensor:
    """The 4-bit codes of uint8 bytes (..., n), low nibble first: (..., 2 n) uint8, a view of
    `work` (int16, packed's shape; default: a new one). Each byte b is widened to an int16
    and spread as (b | b << 4) & 0x0F0F, whose two bytes are then the low and the high code,
    in that order in little-endian memory: four passes over contiguous int16s, where storing
    each nibble into every other byte measured 2-3x slower (strided uint8 stores), and a KV
    cache's codes are unpacked at every decode step."""
    work = torch.empty(packed.shape, dtype=torch.int16, device=packed.device) if work is None else work
    work.copy_(packed)
    work.bitwise_or_(work << 4).bitwise_and_(0x0F0F)
    return work.view(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Inverse of `pack`: (..., nbytes) uint8 -> (..., group_size) uint8 codes (for 8 bits a
    view of `packed` itself: read it, do not write it)."""
    mask = (1 << bits) - 1
    if bits == 8:  # a code a byte: the bytes are the codes (a shift and a mask would copy them twice)
        return packed[..., :group_size]
    if bits == 4 and LITTLE_ENDIAN:
        return nibbles(packed)[..., :group_size]
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)
        return codes[..., :group_size]
    byte_bits = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(-1) >> byte_bits) & 1).flatten(-2)[..., : group_size * bits]
    bit_idx = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    return (stream.unflatten(-1, (group_size, bits)) << bit_idx).sum(-1, dtype=torch.uint8)


def _round_up_to(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast non-negative s to dtype, rounding up (never down) so the scale covers the range."""
    out = s.to(dtype)
    if out.dtype == s.dtype:
        return out
    ints = _INT_VIEW[out.element_size()]
    # For non-negative finite floats the next representable value up is the bit pattern + 1.
    bumped = (out.view(ints) + 1).view(dtype)
    return torch.where(out.to(s.dtype) < s, bumped, out)


def row_blocks(shape, group_dim: int, group_size: int, chunk_elements: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """Ranges of dim 0 of about chunk_elements elements each; whole groups when dim 0 is
    the group dim, so that each block quantizes exactly as it does inside the whole."""
    rows = shape[0]
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, chunk_elements // per_row)
    if group_dim == 0:
        step = max(group_size, step // group_size * group_size)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def quantize(x: torch.Tensor, cfg: Compression, group_dim: int,
             chunk_elements: int = CHUNK_ELEMENTS) -> QuantizedTensor:
    """Quantize a floating-point tensor group-wise along `group_dim` (layout: module doc).
    Works on blocks of rows, so the float32 working copies stay small whatever the
    tensor's size (a 175B model's embedding would otherwise need ~10 GB of them)."""
    cfg, gd, blocks = _prepared(x, cfg, group_dim, chunk_elements)
    if len(blocks) <= 1:  # one block, or no rows at all
        return _quantize_block(x, cfg, gd)
    # every stored part keeps dim 0 (as rows, or as whole groups of rows), so blocks concatenate
    parts = [_quantize_block(x[start:end], cfg, gd) for start, end in blocks]
    return dataclasses.replace(parts[0], shape=tuple(x.shape),
                               **{name: torch.cat([getattr(p, name) for p in parts])
                                  for name in ("data", "scale", "min")})


def _prepared(x: torch.Tensor, cfg: Compression, group_dim: int, chunk_elements: int
              ) -> tuple[Compression, int, list[tuple[int, int]]]:
    """What quantize (and fake_quantize) need, checked: the setting (a per-channel group made
    the group dim's size), the non-negative group dim, and the blocks of rows to work on."""
    cfg.validate("compression")
    if cfg.method in CALIBRATED_METHODS:
        raise ValueError(f"{cfg.method} quantizes a weight against its calibration inputs (compression/gptq.py, "
                         "run at conversion into the compressed store); quantize() has none")
    if cfg.method in SOURCE_CODE_METHODS:
        raise ValueError(f"{cfg.method} takes a weight file's own codes (weights/gguf_codes.py); quantize() "
                         "has a float tensor, no codes")
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize takes a tensor with at least one dimension")
    gd = group_dim % x.dim()
    if x.shape[gd] == 0:
        raise ValueError(f"cannot quantize an empty group dimension (shape {tuple(x.shape)})")
    if cfg.group_size == PER_CHANNEL:  # one group along the whole of group_dim
        cfg = dataclasses.replace(cfg, group_size=x.shape[gd])
    if cfg.method != "rtn":  # more working copies than RTN's: smaller blocks
        chunk_elements = min(chunk_elements, FIT_CHUNK_ELEMENTS)
    return cfg, gd, row_blocks(x.shape, gd, cfg.group_size, chunk_elements)


def _quantize_block(x: torch.Tensor, cfg: Compression, gd: int) -> QuantizedTensor:
    codes, scale, mn = _grid(x, cfg, gd)
    return QuantizedTensor(
        data=pack(codes.to(torch.uint8).movedim(gd + 1, -1), cfg.bits).contiguous(),
        scale=scale.contiguous(),
        min=mn.to(x.dtype).contiguous(),
        shape=tuple(x.shape),
        dtype=x.dtype,
        bits=cfg.bits,
        group_size=cfg.group_size,
        group_dim=gd,
    )


@functools.lru_cache(maxsize=None)
def _levels_on(levels: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`levels` as a 0-dim tensor on `device`, made once (a KV cache quantizes at every write)."""
    return torch.full((), levels, dtype=dtype, device=device)


def _grid(x: torch.Tensor, cfg: Compression, gd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's groups along gd on their grid: the codes (whole numbers, in the working dtype,
    x's layout with the group dim split in two, (..., ng, G, ...), the last group padded),
    the scales as stored (x's dtype) and the mins in the working dtype (exactly the stored
    ones, x's dtype)."""
    bits, G = cfg.bits, cfg.group_size
    n = x.shape[gd]
    ng = -(-n // G)
    levels = (1 << bits) - 1
    work = torch.float64 if x.dtype == torch.float64 else torch.float32

    # Work in x's own layout with the group dim split in two, (..., ng, G, ...): reductions
    # and arithmetic then read x in order, and only the uint8 codes are transposed to put
    # each group's codes last for packing (a float transpose costs several times more).
    if ng * G != n:  # pad by repeating the last element: it cannot change any group's min/max
        tail = list(x.shape)
        tail[gd] = ng * G - n
        x = torch.cat([x, x.narrow(gd, n - 1, 1).expand(tail)], dim=gd)
    xg = x.unflatten(gd, (ng, G)).to(work)

    if cfg.method == "rtn":
        mn = xg.amin(gd + 1)  # exactly representable in x.dtype: it is one of x's elements
        # divided by a tensor on x's device: CUDA divides by a Python number as a multiply by
        # its reciprocal, a float32 ulp off a true quotient, so a range that is an exact
        # multiple of `levels` rounded up to the next scale, and CUDA's codes differed from the
        # CPU's (test_cuda_matches_cpu on an H100: 3, 4 and 6 bits; runs/gpu/h100-2026-11-26)
        scale = _round_up_to((xg.amax(gd + 1) - mn) / _levels_on(levels, work, xg.device), x.dtype)
    else:  # "hqq": fitted; stored in x.dtype as is (codes are clamped, so no coverage is owed)
        fitted_scale, fitted_min = fit_scale_min(xg, gd + 1, levels)
        scale, mn = fitted_scale.to(x.dtype), fitted_min.to(x.dtype).to(work)
    s = scale.to(work)
    # Codes from the *stored* scale and min, so dequantize reproduces them exactly; a zero
    # range (constant group) gets code 0 and scale 0, hence dequantizes to min exactly.
    safe = torch.where(s > 0, s, torch.ones_like(s))
    # in place on one working copy: a KV cache quantizes its new groups at every write
    codes = (xg - mn.unsqueeze(gd + 1)).div_(safe.unsqueeze(gd + 1)).round_().clamp_(0, levels)
    return codes, scale, mn


def codes_of(q: QuantizedTensor) -> torch.Tensor:
    """The integer codes, unpacked, in the original shape (padding dropped); uint8."""
    gd = q.group_dim
    codes = unpack(q.data.movedim(gd, -2), q.bits, q.group_size)  # (..., ng, G)
    return codes.flatten(-2)[..., : q.shape[gd]].movedim(-1, gd)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None,
               chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """min + code * scale, in the original shape; computed in float32 (float64 for float64
    tensors), then cast to `dtype` (default: the original dtype). A tensor of several
    blocks of rows is done block by block into the output, so the float32 working copies
    stay small."""
    dtype = dtype or q.dtype
    blocks = row_blocks(q.shape, q.group_dim, q.group_size, chunk_elements)
    if len(blocks) <= 1:  # the common case: cast once, no copy when it is float32 already
        return _dequantize_block(q).to(dtype).contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for start, end in blocks:
        out[start:end].copy_(_dequantize_block(q.narrow(0, start, end - start)))
    return out


def _dequantize_block(q: QuantizedTensor) -> torch.Tensor:
    """The values in the working dtype (a view that drops the group padding)."""
    gd = q.group_dim
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    # Unpack, then move each group's codes next to its group index while still uint8, so
    # the float arithmetic runs in the output's layout (..., ng, G, ...).
    codes = unpack(q.data, q.bits, q.group_size).movedim(-1, gd + 1).contiguous()
    x = codes.to(work)
    x.mul_(q.scale.unsqueeze(gd + 1).to(work)).add_(q.min.unsqueeze(gd + 1).to(work))  # plain, unfused
    return x.flatten(gd, gd + 1).narrow(gd, 0, q.shape[gd])


# scratch(shape, dtype) -> a tensor to write into: where dequantize_into's working copies come
# from (a caller that dequantizes every step hands out the same ones again; default: new ones)
Scratch = Callable[[tuple, torch.dtype], torch.Tensor]


def dequantize_into(q: QuantizedTensor, out: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """dequantize(q, out.dtype) written into `out` (q's shape, any strides, e.g. a transposed
    view of a buffer reused from step to step), equal to it bit for bit: code * scale + min
    in float32 (float64 for float64 tensors), then rounded to out's dtype.

    Every step that converts a dtype runs on contiguous tensors in the data's own layout
    (each group's members last), and only same-dtype copies write out's strides: a
    conversion and a strided write in one op measured ~10x slower on the CPU (OPT-1.3B's
    cache of a GPU batch, 4 x 32 heads x 512 positions: ~70 ms against ~7 ms, one thread).
    The working copies (codes, the float values, the rounded ones) come from `scratch`, so a
    caller that keeps them allocates nothing per call."""
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"dequantize_into: out has shape {tuple(out.shape)}, the tensor {tuple(q.shape)}")
    scratch = scratch or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device))
    gd, G, bits = q.group_dim, q.group_size, q.bits
    work_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if bits == 4 and LITTLE_ENDIAN:
        codes = nibbles(q.data, scratch(tuple(q.data.shape), torch.int16))[..., :G]
    elif bits == 8:  # a code a byte: the bytes are the codes
        codes = q.data[..., :G]
    elif 8 % bits == 0:  # whole codes per byte: one shift per code of a byte, into its place
        per_byte = 8 // bits
        codes = scratch((*q.data.shape, per_byte), torch.uint8)
        for j in range(per_byte):
            torch.bitwise_right_shift(q.data, j * bits, out=codes[..., j])
        if bits < 8:
            codes.bitwise_and_((1 << bits) - 1)
        codes = codes.flatten(-2)[..., :G]
    else:
        codes = unpack(q.data, bits, G)
    work = scratch((*q.data.shape[:-1], G), work_dtype)  # (..., ng, ..., G): the data's layout
    work.copy_(codes)
    work.mul_(q.scale.unsqueeze(-1).to(work_dtype))  # then + min: plain, unfused, as dequantize
    ng = q.data.shape[gd]
    if out.dtype == work_dtype and ng * G == q.shape[gd]:
        # the addition writes out's strides itself (no conversion in it, so at the speed of a
        # copy): one pass over the values fewer, half of an 8-bit cache's unpack on the CPU
        torch.add(work.movedim(-1, gd + 1), q.min.unsqueeze(-1).movedim(-1, gd + 1), out=out.unflatten(gd, (ng, G)))
        return out
    work.add_(q.min.unsqueeze(-1))
    if out.dtype != work_dtype:
        rounded = scratch(tuple(work.shape), out.dtype)
        work = rounded.copy_(work)
    grouped = work.movedim(-1, gd + 1)  # (..., ng, G, ...): a view, in q's order of dims
    if ng * G == q.shape[gd]:  # out split the same way: a view too, no copy in between
        out.unflatten(gd, (ng, G)).copy_(grouped)
    else:  # the last group's padding is cut off
        out.copy_(grouped.flatten(gd, gd + 1).narrow(gd, 0, q.shape[gd]))
    return out


def fake_quantize(x: torch.Tensor, cfg: Compression, group_dim: int) -> torch.Tensor:
    """Simulated quantization: what the engine computes with, in x's shape and dtype. Bit for
    bit dequantize(quantize(x)) - code * scale + min in the working dtype, unfused, then cast -
    without packing and unpacking the codes: a KV cache held dense rounds every write with it
    (Policy.keep_dense_cache): 1.7x faster at a decode step's one position
    (runs/compression_8bit/decode_paths/cache_step_costs.py)."""
    cfg, gd, blocks = _prepared(x, cfg, group_dim, CHUNK_ELEMENTS)
    if len(blocks) <= 1:
        return _fake_block(x, cfg, gd)
    out = torch.empty_like(x)
    for start, end in blocks:
        out[start:end] = _fake_block(x[start:end], cfg, gd)
    return out


def _fake_block(x: torch.Tensor, cfg: Compression, gd: int) -> torch.Tensor:
    codes, scale, mn = _grid(x, cfg, gd)
    work = codes.dtype
    values = codes.mul_(scale.unsqueeze(gd + 1).to(work)).add_(mn.unsqueeze(gd + 1))  # as _dequantize_block
    return values.flatten(gd, gd + 1).narrow(gd, 0, x.shape[gd]).to(x.dtype).contiguous()
