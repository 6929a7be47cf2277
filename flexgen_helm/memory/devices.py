"""The compute device and what the three tiers mean on this machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexgen_helm.errors import FlexGenError

# The compute dtypes, by the names that flags, manifests and profiles use
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Devices:
    """`compute` runs the math. The "gpu" tier is the compute device's memory; on a
    CPU-only machine that is a budgeted pool of host memory, so every placement and
    schedule runs (and is testable) without a GPU."""

    compute: torch.device
    dtype: torch.dtype

    @property
    def cpu(self) -> torch.device:
        return torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.compute.type == "cuda"

    def tier_device(self, tier: str) -> torch.device:
        return self.compute if tier == "gpu" else self.cpu


def pick_devices(device: str | None = None, dtype: str | None = None) -> Devices:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FlexGenError(f"device {device!r} asked for, but torch sees no CUDA GPU on this machine")
    if dtype is None:
        dtype = default_dtype(dev)
    if dtype not in DTYPES:
        raise FlexGenError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return Devices(dev, DTYPES[dtype])


def default_dtype(device: torch.device) -> str:
    """fp16 on GPUs, as in the paper. On a CPU, bf16 only where the CPU has bf16 arithmetic
    (AVX512-BF16 or AMX on x86, the BF16 extension on ARM): elsewhere torch emulates it and
    a bf16 matmul is ~10x slower than fp32 (AVX2 EPYC, 2 cores: SmolLM2 LAMBADA scoring
    4.4x slower end to end, measured with `flexgen-helm eval --dtype`); fp16 is slow on
    every CPU."""
    if device.type == "cuda":
        return "float16"
    return "bfloat16" if cpu_has_bf16_arithmetic() else "float32"


def cpu_has_bf16_arithmetic() -> bool:
    caps = torch.cpu.get_capabilities()
    return any(caps.get(flag, False) for flag in ("avx512_bf16", "amx_bf16", "bf16"))

