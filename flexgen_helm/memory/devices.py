"""The compute device and what the three tiers mean on this machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexgen_helm.errors import FlexGenError


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
        # fp16 on GPUs as in the paper; bf16 on CPUs, where fp16 matmuls are slow.
        dtype = "float16" if dev.type == "cuda" else "bfloat16"
    names = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in names:
        raise FlexGenError(f"dtype {dtype!r} is not one of {', '.join(names)}")
    return Devices(dev, names[dtype])
