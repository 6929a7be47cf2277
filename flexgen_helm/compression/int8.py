"""8-bit weights in the layout of torch's int8 weight-only matmul, `aten._weight_int8pack_mm`
(CPU and CUDA): int8 codes (out, in) and one scale per output channel, y = x (q s)^T.

Its grid is one group per output row (`Compression.group_size = PER_CHANNEL`), not FlexGen's
groups of 64: a row's min/max codes w = min + code * scale (code in 0..255) are stored as
q = code - 128 (the uint8 code with its top bit flipped, read as int8) and the row's zero
z = min + 128 scale, so w = q scale + z and y = x (q s)^T + (sum of x's row) z, the kernel's
product and one outer product. Scale and zero are kept in the compute dtype (the kernel takes
its scales in the activations' dtype): both rounded once, at packing, and the dequantize path
decodes the same rounded values, so both paths compute with the same weights.

The layout is the same on every device (no tiles, no nibble order) and every part is indexed
by output row, so any row range is a packed weight of its own (placement cuts anywhere).

Which rows take the kernel: up to MAX_KERNEL_ROWS activation rows per device type (decode
steps, where a matmul reads each weight once and the kernel reads half of bf16's bytes);
above, a dense copy dequantized once per use of the loaded layer meets the rows in a plain
matmul. `flexgen-helm profile` measures the crossover of each machine (the engines a command
loads then use it); without a profile the default below, not measured on this project's
machines yet (runs/compression_8bit/matmul_8bit.py shows the paths side by side).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flexgen_helm.compression.bundle import TensorBundle
from flexgen_helm.compression.quantize import QuantizedTensor

KERNEL_BITS = 8
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
LAYOUT = "int8"
# Activation rows up to which the int8 kernel runs, per device type (None: every row count).
# CPU: the int4 kernel's measured crossover, as a first guess until matmul_8bit.py's is in;
# CUDA: the kernel takes every row count, as the int4 kernel does there.
MAX_KERNEL_ROWS = {"cpu": 128, "cuda": None}


def set_max_kernel_rows(device_type: str, rows: int | None) -> None:
    """The crossover int8 weights loaded from now on use on `device_type` (None: the kernel
    takes every row count, 0: none); `flexgen-helm profile` measures it
    (planner/hardware_profile.use_profile sets it)."""
    if device_type not in MAX_KERNEL_ROWS:
        raise ValueError(f"the int8 kernel runs on {', '.join(MAX_KERNEL_ROWS)}, not {device_type!r}")
    if rows is not None and rows < 0:
        raise ValueError(f"a kernel crossover is a row count >= 0 or None, got {rows}")
    MAX_KERNEL_ROWS[device_type] = rows


def layout_refusal(cfg, shape, group_dim: int | None) -> str | None:
    """Why a weight under this compression cannot take the int8 kernel's layout, or None."""
    if group_dim is None:
        return "not compressed"
    if cfg.bits != KERNEL_BITS:
        return f"{cfg.bits}-bit weights (the int8 kernel takes {KERNEL_BITS} bits)"
    if len(tuple(shape)) != 2 or group_dim != 1 or cfg.group_size != shape[1]:
        return (f"8-bit weights in groups of {cfg.group_size} (the int8 kernel takes one group per output "
                "channel: group_size -1)")
    return None


def device_refusal(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the int8 kernel cannot compute on this device in this dtype, or None."""
    if dtype not in KERNEL_DTYPES:
        # float32 keeps results independent of the row count (the kernel and the dequantize
        # path round differently), which policy invariance relies on, as for the int4 kernels
        return f"{str(dtype).removeprefix('torch.')} compute (the int8 path computes in bfloat16 or float16)"
    if device.type not in MAX_KERNEL_ROWS:
        return f"device {device.type} (the int8 kernel runs on {', '.join(MAX_KERNEL_ROWS)})"
    return None


@dataclass(frozen=True, eq=False)
class PackedInt8(TensorBundle):
    """An 8-bit (out, in) weight in the int8 kernel's layout (module doc)."""

    packed: torch.Tensor  # int8 (out, in): code - 128
    scales: torch.Tensor  # (out,) in the compute dtype
    zeros: torch.Tensor  # (out,) in the compute dtype: min + 128 scale
    shape: tuple  # (out, in)

    def narrow(self, dim: int, start: int, length: int) -> "PackedInt8":
        if dim != 0:
            raise ValueError(f"a packed int8 weight is cut along its output rows, got narrow({dim}, ...)")
        return dataclasses.replace(self, packed=self.packed.narrow(0, start, length),
                                   scales=self.scales.narrow(0, start, length),
                                   zeros=self.zeros.narrow(0, start, length), shape=(length, self.shape[1]))

    def rows(self, ids: torch.Tensor) -> "PackedInt8":
        """Output rows `ids` (1-D), as a packed weight of their own."""
        return dataclasses.replace(self, packed=self.packed[ids], scales=self.scales[ids], zeros=self.zeros[ids],
                                   shape=(len(ids), self.shape[1]))


def pack_int8(q: QuantizedTensor, dtype: torch.dtype) -> PackedInt8:
    """The kernel layout of an 8-bit weight grouped by whole rows (scales and zeros in `dtype`)."""
    n, k = q.shape
    if q.bits != KERNEL_BITS or q.group_dim != 1 or q.group_size != k:
        raise ValueError(f"the int8 layout takes 8-bit weights with one group per row, got {q.bits} bits, "
                         f"groups of {q.group_size} along dim {q.group_dim} of {q.shape}")
    codes = q.data.reshape(n, k)  # one group of k one-byte codes per row
    packed = torch.bitwise_xor(codes, 0x80).view(torch.int8)  # code - 128, bit for bit
    scale = q.scale.reshape(n).float()
    zero = q.min.reshape(n).float() + 128 * scale
    return PackedInt8(packed.contiguous(), scale.to(dtype).contiguous(), zero.to(dtype).contiguous(), (n, k))


def dequantize_int8(p: PackedInt8, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight both paths compute with: q * scale + zero in float32, then `dtype`."""
    w = p.packed.float().mul_(p.scales.float()[:, None]).add_(p.zeros.float()[:, None])
    return w.to(dtype)


def int8_mm(x: torch.Tensor, p: PackedInt8) -> torch.Tensor:
    """x (rows, in) @ weight^T on the packed bytes: the kernel's x (q s)^T, plus each row's
    zero times the sum of x's row (summed in float32)."""
    y = torch.ops.aten._weight_int8pack_mm(x, p.packed, p.scales)
    y += (x.sum(-1, keepdim=True, dtype=torch.float32) * p.zeros.float()).to(y.dtype)
    return y
