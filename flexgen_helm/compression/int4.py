"""4-bit weights in the layout of torch's int4 matmul kernels, and the one place where a
compressed weight meets an activation (`CompressedWeight.linear`; 8-bit weights per output
channel take the int8 kernel there, compression/int8.py).

The kernels: `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`
on the CPU, `aten._convert_weight_to_int4pack` + `aten._weight_int4pack_mm` (tinygemm) on
CUDA. Both take groups along the input dimension (dim 1 of a Linear's (out, in) weight) of
32, 64, 128 or 256 codes, and a bfloat16 `scales_and_zeros` of shape (in / group, out, 2)
meaning w = (q - 8) * scale + zero. FlexGen's min/max group w = min + q * scale is that with
zero = min + 8 * scale (rounded to bfloat16 once, at packing; the dequantize path below
decodes the same rounded scale and zero, so both paths compute with the same weights).

Why the aten ops and not torchao (evaluated: torchao 0.18.0, the newest on PyPI, installs
beside torch 2.13 without pulling another torch): on the CPU its stable int4 weight-only
config either needs another package (`mslk`, the default "plain" format) or refuses the
CPU ("plain_int32"); its CPU format ("opaque") lives under `prototype` and moves between
releases; its weights are tensor subclasses meant for `torch.save`, whereas our tiers move
raw bytes (weights/store.py reads row ranges of raw files); and its int4 path is a thin
wrapper over these same two aten ops, which would still need FlexGen's min/max codes
mapped onto them by us. So the dependency would add an import (~4 s) and no kernel.

Layouts, and why a stored weight is in its compute device's layout:
- CPU: uint8 (out, in / 2); whole blocks of B output rows are laid out [in][B / 2] with
  row i in the low nibble and row i + B / 2 in the high one; a tail of fewer rows is
  [in][rows / 2] with rows 2i (low) and 2i + 1 (high). B follows the CPU's vector width (this
  torch: 64 with AVX-512, 32 with AVX2), so the layout is a property of the machine:
  `cpu_block` probes once which B the converter writes, checking that it produces exactly
  what `_cpu_codes_by_column` decodes, and the kernel path is refused (with a log line) where
  it is neither. A store's name carries B where it is not 64 (store_layout), so that a store
  packed on another machine is never decoded with this one's B.
- CUDA: int32 tiles (out / 8, in / (16 * inner_k_tiles), 32, inner_k_tiles / 2) from a
  uint8 (out, in / 2) whose even input index sits in the high nibble (as torchao's tinygemm
  path feeds it); decoded, for the dequantize path, by the kernel itself against an
  identity (each output is one weight times 1.0).
So no layout is device-neutral; a weight is packed once, when it is placed, for the device
that computes with it, and every tier (the disk store too, whose name carries the layout)
holds those bytes: a read is usable as it lands. Row ranges cut on ROW_BLOCK rows are
packed matrices of their own in both layouts, so placement cuts packed weights there.

The kernel is chosen per call by the number of activation rows: up to `max_kernel_rows`
(measured by `flexgen-helm profile` on each machine, or runs/bench/compression/kernel_crossover.py
for the defaults) it runs on the packed bytes; above,
a dequantized copy (made once per use of the loaded layer, i.e. once per block) meets the
rows in a plain matmul, which the kernel loses to at prefill sizes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from flexgen_helm.compression import int8
from flexgen_helm.compression.bundle import TensorBundle
from flexgen_helm.compression.dense_copies import DENSE_COPIES
from flexgen_helm.compression.quantize import QuantizedTensor, codes_of, dequantize
from flexgen_helm.dense_linear import PackedLinear, dense_linear, packs_linear_weights
from flexgen_helm.policy.policy import Compression

logger = logging.getLogger(__name__)

KERNEL_BITS = 4
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
KERNEL_DTYPE = torch.bfloat16
ROW_MULTIPLE = 16  # the CPU converter's rule for the output dim
ROW_BLOCK = 64  # where placement cuts packed rows: a multiple of every CPU block and of CUDA's 8-row tiles
_CPU_BLOCKS = (64, 32)  # the CPU converter's blocks of output rows: AVX-512's, AVX2's
_CUDA_TILE_ROWS = 8
# Activation rows up to which the kernel beats dequantize-then-matmul, per device type (None:
# every row count), for the engines this process loads. The defaults were measured alone with
# runs/bench/compression/kernel_crossover.py (CPU, AVX512-BF16 EPYC: 128 for OPT-1.3B and
# SmolLM2-135M alike; kernel_crossover.json; CUDA: not measured, so the kernel takes every row
# count there); the commands that load an engine replace them with this machine's profiled
# crossover (set_max_kernel_rows, from planner/hardware_profile.use_profile).
MAX_KERNEL_ROWS = {"cpu": 128, "cuda": None}
# Activation rows up to which a weight whose dense copy is held anyway (kept for a block,
# executor/kept_weights.py, packed where the machine packs: dense_linear.PackedLinear) still
# multiplies on its codes, per device type and kernel ("int4", "int8"): at a decode step's
# few rows the kernel reads 2-4x fewer bytes than the copy (AVX512-BF16 EPYC, the profile's
# smaller gain of two streamed shapes: int4 2.4x the packed copy's speed at 1-2 rows, 1.2x at
# 8, 0.7x at 16; int8 1.2-1.4x at 1-4 rows, 0.84x at 8: runs/compression_8bit/decode_paths/
# profile_kernels_2026-11-28.txt). 0 (the copy at every row count)
# until `flexgen-helm profile` measured where the kernel wins (set_kernel_over_kept_rows, from
# planner/hardware_profile.use_profile), for the compute dtype it was measured in: the bits of
# a bf16 product differ between the paths. (device type, kernel, dtype) -> rows.
KERNEL_OVER_KEPT_ROWS: dict[tuple[str, str, torch.dtype], int] = {}
# Elements per piece of a CPU dequantization: its float32 working copies (4 MiB each) stay in
# the core's cache. One thread, freed memory kept (host_allocator.py), SmolLM2's 49152 x 576
# head: pieces of 16 M elements 42 ms, 1 M 32 ms, 256 K 35 ms, 64 K 72 ms (Python per piece);
# OPT's 8192 x 2048: 26, 17, 20, 23 ms (indicative: thread CPU time, shared 2-core EPYC, load ~12).
DEQUANTIZE_CHUNK_ELEMENTS = 1 << 20


def set_max_kernel_rows(device_type: str, rows: int | None) -> None:
    """The crossover CompressedWeights loaded from now on use on `device_type` (None: the
    kernel takes every row count, 0: none)."""
    if device_type not in MAX_KERNEL_ROWS:
        raise ValueError(f"the int4 kernels run on {', '.join(MAX_KERNEL_ROWS)}, not {device_type!r}")
    if rows is not None and rows < 0:
        raise ValueError(f"a kernel crossover is a row count >= 0 or None, got {rows}")
    MAX_KERNEL_ROWS[device_type] = rows


def layout_refusal(cfg: Compression, shape, group_dim: int | None) -> str | None:
    """Why a weight under this compression cannot have the kernels' packed layout (on any
    device), or None when it can."""
    if group_dim is None:
        return "not compressed"
    if cfg.bits != KERNEL_BITS:
        return f"{cfg.bits}-bit weights (the int4 kernels take {KERNEL_BITS} bits)"
    if len(tuple(shape)) != 2 or group_dim != 1:
        return "groups along dim 0 (the int4 kernels group along the input dimension, dim 1)"
    if cfg.group_size not in KERNEL_GROUP_SIZES:
        return f"group size {cfg.group_size} (the int4 kernels take {', '.join(map(str, KERNEL_GROUP_SIZES))})"
    n, k = shape
    if n % ROW_MULTIPLE or k % cfg.group_size:
        return f"a ({n}, {k}) weight (the int4 kernels need out % {ROW_MULTIPLE} == 0 and in % group == 0)"
    return None


def device_refusal(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernels cannot compute on this device in this dtype, or None when they can."""
    if dtype != KERNEL_DTYPE:
        # float32 also keeps results independent of how many rows a call has (the kernel
        # and the dequantize path round differently), which policy invariance relies on.
        return f"{str(dtype).removeprefix('torch.')} compute (the int4 kernels compute in bfloat16)"
    if device.type == "cpu" and cpu_block() is None:
        return (f"this CPU's int4pack layout (torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}) "
                "is not the one this engine decodes")
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type} (the int4 kernels run on cpu and cuda)"
    return None


_logged: set[str] = set()


def log_slow_path_once(reason: str) -> None:
    """One log line per reason and process: the settings, not the data, decide the path."""
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("compressed weights: dequantize-then-matmul instead of the int4 or int8 kernel because of %s",
                       reason)


@dataclass(frozen=True, eq=False)
class PackedInt4(TensorBundle):
    """A 4-bit (out, in) weight in one device type's int4 kernel layout (module doc)."""

    packed: torch.Tensor  # cpu: uint8 (out, in / 2); cuda: int32 tiles (out / 8, ...)
    scales_zeros: torch.Tensor  # bfloat16 (in / group, out, 2), contiguous: the kernels misread strides
    shape: tuple  # (out, in)
    group_size: int
    layout: str  # "cpu" or "cuda": whose kernel these bytes are for

    def narrow(self, dim: int, start: int, length: int) -> "PackedInt4":
        """Output rows [start, start + length), cut on ROW_BLOCK rows (or the end): the
        packed bytes are a view; the scales are copied (the kernels need them contiguous)."""
        n = self.shape[0]
        if dim != 0 or start % ROW_BLOCK or (length % ROW_BLOCK and start + length != n):
            raise ValueError(f"a packed weight is cut on blocks of {ROW_BLOCK} output rows: "
                             f"got narrow({dim}, {start}, {length}) of {self.shape}")
        per = _CUDA_TILE_ROWS if self.layout == "cuda" else 1
        return dataclasses.replace(self, packed=self.packed.narrow(0, start // per, -(-length // per)),
                                   scales_zeros=self.scales_zeros.narrow(1, start, length).contiguous(),
                                   shape=(length, self.shape[1]))


def pack_int4(q: QuantizedTensor, device: torch.device) -> PackedInt4:
    """The kernel layout of `device`'s type for a 4-bit, dim-1 grouped weight (packed on
    `device`, once)."""
    n, k = q.shape
    codes = codes_of(q).to(device)
    scale = q.scale.to(device=device, dtype=torch.float32)
    zero = q.min.to(device=device, dtype=torch.float32) + 8 * scale
    scales_zeros = torch.stack((scale, zero), -1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
    if device.type == "cuda":
        nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, _inner_k_tiles(k))
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    return PackedInt4(packed, scales_zeros, (n, k), q.group_size, device.type)


def _inner_k_tiles(k: int) -> int:
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


def packed_rows(layout: str, rows: tuple[int, int]) -> tuple[int, int]:
    """Rows of the stored packed part that hold output rows [start, end)."""
    per = _CUDA_TILE_ROWS if layout == "cuda" else 1
    return rows[0] // per, -(-rows[1] // per)


def dequantize_packed(p: PackedInt4, dtype: torch.dtype = KERNEL_DTYPE, by_column: bool = True) -> torch.Tensor:
    """The (out, in) weight the kernel computes with, where it lives.

    On the CPU, by_column: the transpose of a contiguous (in, out) matrix. Each 64-row block's
    bytes hold 32-byte runs of consecutive output rows per input column, so decoding them in
    that order copies runs instead of transposing bytes one by one, and the kernel's
    (groups, out) scales apply as they are (SmolLM2's 1536 x 576 weight, one thread: 0.53 ms
    instead of 1.00 ms). Else contiguous (out, in): one transposing copy more, for a copy kept
    for many calls (CompressedWeight.dense)."""
    if p.layout == "cuda":
        return _cuda_dequantize(p).to(dtype)
    n, k = p.shape
    out = torch.empty((k, n) if by_column else (n, k), dtype=dtype, device=p.device)
    groups, g = k // p.group_size, p.group_size
    step = max(ROW_BLOCK, DEQUANTIZE_CHUNK_ELEMENTS // k // ROW_BLOCK * ROW_BLOCK)
    for start in range(0, n, step):
        rows = min(step, n - start)  # whole 64-row blocks (or the tail): a packed matrix of its own
        codes = _signed_codes(_cpu_codes_by_column(p.packed[start:start + rows], rows, k), dtype)
        # scale and zero each contiguous: broadcasting a strided one is ~8x slower
        scale, zero = _affine_terms(p.scales_zeros[:, start:start + rows].permute(2, 0, 1), dtype, 1)
        if by_column and codes.dtype == dtype:  # straight into place
            _affine_into(codes.view(groups, g, rows), scale, zero, out[:, start:start + rows].view(groups, g, rows))
            continue
        w = _affine_into(codes.view(groups, g, rows), scale, zero, codes.view(groups, g, rows)).view(k, rows)
        if by_column:
            out[:, start:start + rows].copy_(w)
        else:  # convert, then transpose in the compute dtype (the two in one copy measured slower)
            out[start:start + rows].copy_(w.to(dtype).t())
    return out.t() if by_column else out


def packed_rows_of(p: PackedInt4, ids: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight the kernel computes with, shape (*ids.shape, in):
    what an embedding lookup needs, without dequantizing the rest (a vocabulary-sized table
    costs ~30 M elements per lookup otherwise). Equal to dequantize_packed(p, dtype)[ids]."""
    if p.layout == "cuda":  # its tiles decode through the kernel, a whole weight at once
        return F.embedding(ids, dequantize_packed(p, dtype))
    n, k = p.shape
    flat = ids.reshape(-1).to(p.device)
    codes = torch.empty(len(flat), k, dtype=torch.uint8, device=p.device)
    block = cpu_block()
    full = n // block * block
    in_blocks = flat < full
    if bool(in_blocks.any()):  # row b * B + B / 2 h + j: nibble h of byte column j, block b
        r = flat[in_blocks]
        blocks = p.packed[:full].view(full // block, k, block // 2)
        shift = (r % block // (block // 2) * 4).to(torch.uint8)
        codes[in_blocks] = blocks[r // block, :, r % (block // 2)] >> shift[:, None] & 15
    if not bool(in_blocks.all()):  # tail row full + t: nibble t % 2 of byte column t // 2
        t = flat[~in_blocks] - full
        tail = p.packed[full:].view(k, (n - full) // 2)
        codes[~in_blocks] = tail[:, t // 2].t() >> ((t % 2) * 4).to(torch.uint8)[:, None] & 15
    scale, zero = _affine_terms(p.scales_zeros[:, flat].permute(2, 1, 0), dtype, -1)  # each (ids, groups, 1)
    rows = _affine_into(_signed_codes(codes, dtype).view(len(flat), k // p.group_size, p.group_size), scale, zero)
    return rows.to(dtype).view(*ids.shape, k)


def _affine_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a dequantization's affine step runs in: the output's where the kernel's bf16
    scales and zeros, and the signed codes, convert to it exactly (bf16, float32), else float32."""
    return dtype if dtype in (KERNEL_DTYPE, torch.float32) else torch.float32


def _signed_codes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes (in place) -> q - 8 in the affine step's dtype (exact: -8..7)."""
    return codes.view(torch.int8).sub_(8).to(_affine_dtype(dtype))


def _affine_terms(scales_zeros: torch.Tensor, dtype: torch.dtype, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (2, ...) scales and zeros as two contiguous tensors in the affine step's
    dtype, each with an axis of 1 inserted at `axis` to broadcast over its group's codes."""
    scale, zero = scales_zeros.to(_affine_dtype(dtype)).contiguous()
    return scale.unsqueeze(axis), zero.unsqueeze(axis)


def _affine_into(signed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """w = (q - 8) * scale + zero, the kernel's formula, over signed codes (_signed_codes;
    scale and zero broadcast over the codes of their group); every way of dequantizing a
    packed weight goes through it, so all round alike. One addcmul: in bf16 too, torch
    computes it in float32 and rounds once, and (q - 8) * scale is exact there (4 x 8
    significant bits), so a bf16 result has the bits of the float32 one rounded to bf16,
    at a third of the float32 passes: an OLMoE expert's dense copy by column 1.2-1.3x faster
    than three float32 passes and a conversion (1024 x 2048 and 2048 x 1024, alone, 2-core EPYC)."""
    return torch.addcmul(zero, signed, scale, out=out)


def _cpu_codes_by_column(packed: torch.Tensor, n: int, k: int, block: int | None = None) -> torch.Tensor:
    """Decode the CPU layout (module doc; blocks of `block` rows, default this machine's)
    back to uint8 codes, as the contiguous transpose (k, n) of the (n, k) weight's codes."""
    block = block or cpu_block()
    full = n // block * block
    parts = []
    if full:
        b = packed[:full].view(full // block, k, 1, block // 2).transpose(0, 1)
        parts.append(torch.cat((b & 15, b >> 4), 2).view(k, full))
    if full < n:
        b = packed[full:].view(k, (n - full) // 2, 1)
        parts.append(torch.cat((b & 15, b >> 4), 2).view(k, n - full))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _cuda_dequantize(p: PackedInt4) -> torch.Tensor:
    n, k = p.shape
    eye = torch.eye(k, dtype=KERNEL_DTYPE, device=p.device)
    return torch.ops.aten._weight_int4pack_mm(eye, p.packed, p.group_size, p.scales_zeros).t()


@lru_cache(maxsize=1)
def cpu_block() -> int | None:
    """The block of output rows this machine's CPU converter packs (module doc), or None where
    it writes no layout `_cpu_codes_by_column` decodes: probed on shapes with whole blocks,
    tails of 16 and 48 rows, and every code value."""
    return next((block for block in _CPU_BLOCKS if _cpu_converter_writes(block)), None)


def _cpu_converter_writes(block: int) -> bool:
    g = torch.Generator().manual_seed(0)
    for n in (64, 128 + 16, 64 + 48, 16):
        codes = torch.randint(0, 16, (n, 64), generator=g, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        if packed.shape != (n, 32) or not torch.equal(
                _cpu_codes_by_column(packed, n, 64, block).t().to(torch.int32), codes):
            return False
    return True


def kernel_rows(layout: str | None, device_type: str) -> int | None:
    """The crossover of the kernel a weight stored in `layout` takes on `device_type`."""
    table = int8.MAX_KERNEL_ROWS if layout == int8.LAYOUT else MAX_KERNEL_ROWS
    return table.get(device_type)


Packed = (PackedInt4, int8.PackedInt8)


class CompressedWeight:
    """A compressed (out, in) weight loaded for one use of its layer: its row segments as
    stored (PackedInt4, PackedInt8 or QuantizedTensor), on the compute device."""

    def __init__(self, parts: list[tuple[int, "PackedInt4 | int8.PackedInt8 | QuantizedTensor"]], shape,
                 dtype: torch.dtype, max_kernel_rows: int | None):
        self.parts = parts  # (first output row, stored rows)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.max_kernel_rows = max_kernel_rows
        self._dense: torch.Tensor | None = None
        self._packed: PackedLinear | None = None  # the dense copy, packed (pack_dense)
        self._kernel_key: tuple | None = None  # (device type, kernel, dtype) of packed parts; (): others; None: unknown

    @property
    def packed(self) -> bool:
        return all(isinstance(p, Packed) for _, p in self.parts)

    def keep_dense(self) -> None:
        """Multiply on the dense copy at every row count from now on (made at the first
        multiply unless made before, then reused): a weight a block keeps for all its steps
        (executor/kept_weights.py)."""
        self.max_kernel_rows = 0

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense copy, once made (0 before), packed or not."""
        if self._packed is not None:
            return self._packed.nbytes
        return 0 if self._dense is None else self._dense.numel() * self._dense.element_size()

    def pack_dense(self) -> None:
        """Hold the dense copy made for every later call (keep_dense) as a PackedLinear where
        this machine packs the weights it keeps in memory (dense_linear.packs_linear_weights),
        in its place: the same products, bit for bit, without oneDNN's reorder of the copy at
        each call. Only a weight whose rows decode apart: a lookup in it then reads the stored
        rows (embedding), never the copy."""
        if (self._dense is None or not self._dense.is_contiguous() or not self.rows_apart
                or not packs_linear_weights(self._dense.device, self.dtype)):
            return
        self._packed = PackedLinear(self._dense)
        self._dense = None

    def uses_kernel(self, rows: int) -> bool:
        return self.packed and (self.max_kernel_rows is None or rows <= self.max_kernel_rows)

    def dense(self, by_column: bool = True) -> torch.Tensor:
        """The weight dequantized in the compute dtype; made once per use of the layer. On the
        CPU by column (dequantize_packed), the quicker to make, for a call at any row count:
        timed as whole paths, dequantize then matmul, by row never paid back its transposing
        pass (by column 1.04-1.71x faster up to 2048 rows and within 3% at 3072-4096 on the
        EPYC, runs/bench/compression/int4/dense_orientation_2026-11-25; 1.05-1.6x faster at
        1024-8192 rows on the Xeon, dense_orientation_2026-11-29_xeon). By row (by_column
        False) for a copy kept for many calls, which is packed or flipped as a plain matrix
        (executor/kept_weights.py)."""
        if self._packed is not None:
            raise AssertionError("a packed dense copy multiplies itself (linear); its rows are looked up stored")
        if self._dense is None:
            if len(self.parts) == 1:
                self._dense = _dequantize_stored(self.parts[0][1], self.dtype, by_column)
            else:  # in the orientation its parts dequantize to, so that each copy is a plain one
                by_column = by_column and all(isinstance(p, PackedInt4) and p.layout == "cpu" for _, p in self.parts)
                device = self.parts[0][1].device
                self._dense = torch.empty(self.shape[::-1] if by_column else self.shape, dtype=self.dtype,
                                          device=device)
                if by_column:
                    self._dense = self._dense.t()
                for start, p in self.parts:
                    self._dense[start:start + p.shape[0]].copy_(_dequantize_stored(p, self.dtype, by_column))
            DENSE_COPIES.track(self, self._dense.numel() * self._dense.element_size())
        return self._dense

    @property
    def rows_apart(self) -> bool:
        """Whether each row decodes without the others (a lookup then needs no dense copy)."""
        return all(_rows_apart(p) for _, p in self.parts)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, weight): only the rows looked up are dequantized where the weight
        is packed for the CPU or grouped along its rows' own elements (the dense copy, where
        this use already made one, or where the layout decodes whole: CUDA's tiles, groups
        along dim 0)."""
        if self._dense is not None or not self.rows_apart:
            return F.embedding(ids, self.dense())
        if len(self.parts) == 1:
            return _stored_rows_of(self.parts[0][1], ids, self.dtype)
        out = torch.empty(*ids.shape, self.shape[1], dtype=self.dtype, device=self.parts[0][1].device)
        for start, p in self.parts:
            mine = (ids >= start) & (ids < start + p.shape[0])
            out[mine] = _stored_rows_of(p, ids[mine] - start, self.dtype)
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias): on the packed bytes when the row count is at most the
        crossover, else on the dense copy. Once a copy is held (kept for the block, or made by
        this use: a scored prompt's head, a chunk of positions at a time), every call takes it
        but those of at most KERNEL_OVER_KEPT_ROWS rows, which the kernel multiplies faster
        where this machine's profile measured it so."""
        rows = x.numel() // self.shape[1]
        held = self._packed is not None or self._dense is not None
        if self.kernel_beats_held_copy(rows) if held else self.uses_kernel(rows):
            return self.kernel_linear(x, bias)
        return self.held_copy_linear(x, bias)

    def kernel_beats_held_copy(self, rows: int) -> bool:
        """Whether a call of `rows` rows multiplies on the codes though the dense copy is held
        (KERNEL_OVER_KEPT_ROWS, this machine's profile)."""
        if self._kernel_key is None:  # worked out once: a bundle's device is a walk over its fields
            p = self.parts[0][1]
            self._kernel_key = (p.device.type, kernel_name(p), self.dtype) if self.packed else ()
        return bool(self._kernel_key) and rows <= KERNEL_OVER_KEPT_ROWS.get(self._kernel_key, 0)

    def held_copy_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) on the dense copy held (made now if it is not)."""
        if self._packed is not None:
            return self._packed.linear(x, bias)
        return dense_linear(x, self.dense(), bias)

    def kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) on the packed codes, by the kernel."""
        rows = x.numel() // self.shape[1]
        x2 = x.reshape(rows, self.shape[1]).contiguous()
        if len(self.parts) == 1:
            y = _kernel_mm(x2, self.parts[0][1])
        else:
            y = torch.cat([_kernel_mm(x2, p) for _, p in self.parts], dim=1)
        if bias is not None:
            y += bias
        return y.view(*x.shape[:-1], self.shape[0])


def set_kernel_over_kept_rows(device_type: str, kernel: str, dtype: torch.dtype, rows: int) -> None:
    """Weights computing in `dtype` whose dense copy is held multiply on their `kernel` codes
    ("int4", "int8") up to `rows` activation rows on `device_type` from now on (0: never)."""
    if kernel not in ("int4", "int8"):
        raise ValueError(f"a kernel is 'int4' or 'int8', got {kernel!r}")
    if rows < 0:
        raise ValueError(f"a row count >= 0, got {rows}")
    KERNEL_OVER_KEPT_ROWS[(device_type, kernel, dtype)] = rows


def clear_kernel_over_kept_rows() -> None:
    """No held copy's rows take a kernel from now on (until set_kernel_over_kept_rows)."""
    KERNEL_OVER_KEPT_ROWS.clear()


def kernel_name(p: "PackedInt4 | int8.PackedInt8") -> str:
    """Which kernel multiplies a packed part: "int8" or "int4"."""
    return "int8" if isinstance(p, int8.PackedInt8) else "int4"


def _rows_apart(p: "PackedInt4 | int8.PackedInt8 | QuantizedTensor") -> bool:
    """Whether a row of `p` decodes without the others."""
    if isinstance(p, PackedInt4):
        return p.layout == "cpu"
    return isinstance(p, int8.PackedInt8) or p.group_dim != 0


def _stored_rows_of(p: "PackedInt4 | QuantizedTensor", ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the stored weight, dequantized: equal to _dequantize_stored(p, dtype)[ids]
    (each element's arithmetic is the same)."""
    if isinstance(p, PackedInt4):
        return packed_rows_of(p, ids, dtype)
    flat = ids.reshape(-1).to(p.device)
    if isinstance(p, int8.PackedInt8):
        return int8.dequantize_int8(p.rows(flat), dtype).view(*ids.shape, p.shape[1])
    rows = dataclasses.replace(p, data=p.data[flat], scale=p.scale[flat], min=p.min[flat],
                               shape=(len(flat), *p.shape[1:]))
    return dequantize(rows, dtype).view(*ids.shape, *p.shape[1:])


def _kernel_mm(x: torch.Tensor, p: "PackedInt4 | int8.PackedInt8") -> torch.Tensor:
    if isinstance(p, int8.PackedInt8):
        return int8.int8_mm(x, p)
    if p.layout == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, p.packed, p.group_size, p.scales_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, p.packed, p.group_size, p.scales_zeros)


def _dequantize_stored(p: "PackedInt4 | int8.PackedInt8 | QuantizedTensor", dtype: torch.dtype,
                       by_column: bool) -> torch.Tensor:
    if isinstance(p, int8.PackedInt8):
        return int8.dequantize_int8(p, dtype)
    return dequantize_packed(p, dtype, by_column) if isinstance(p, PackedInt4) else dequantize(p, dtype)
