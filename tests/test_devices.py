"""Which compute dtype a run gets when it does not name one."""

from __future__ import annotations

import pytest
import torch

from flexgen_helm.errors import FlexGenError
from flexgen_helm.memory.devices import pick_devices


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16"])
def test_cpu_with_bf16_arithmetic_defaults_to_bfloat16(monkeypatch, flag):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, flag: True})
    assert pick_devices("cpu").dtype == torch.bfloat16


def test_cpu_without_bf16_arithmetic_defaults_to_float32(monkeypatch):
    # emulated bf16 matmuls are ~10x slower than fp32 on such CPUs (AVX2 only)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": False})
    assert pick_devices("cpu").dtype == torch.float32


def test_named_dtype_wins_over_the_default(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    assert pick_devices("cpu", "bfloat16").dtype == torch.bfloat16


def test_unknown_dtype_is_named():
    with pytest.raises(FlexGenError, match="'int3' is not one of"):
        pick_devices("cpu", "int3")
