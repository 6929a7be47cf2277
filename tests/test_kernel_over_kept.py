"""A compressed weight whose dense copy is held for the block (kept_weights.py) still multiplies
on its codes at a decode step's few rows, up to the row count this machine's profile measured
the kernel faster than the copy (compression/int4.KERNEL_OVER_KEPT_ROWS); unprofiled, never."""

import json

import pytest
import torch

from flexgen_helm.compression import int4
from flexgen_helm.compression.int4 import CompressedWeight, device_refusal, pack_int4, set_kernel_over_kept_rows
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile
from flexgen_helm.policy.policy import Compression

needs_int4_kernel = pytest.mark.skipif(device_refusal(torch.bfloat16, torch.device("cpu")) is not None,
                                       reason="the int4 kernel does not run on this CPU")


@pytest.fixture
def kept_weight(monkeypatch):
    monkeypatch.setattr(int4, "KERNEL_OVER_KEPT_ROWS", {})
    torch.manual_seed(0)
    packed = pack_int4(quantize(torch.randn(128, 64).bfloat16(), Compression(4, 32, 1), 1), torch.device("cpu"))
    kept, codes = (CompressedWeight([(0, packed)], (128, 64), torch.bfloat16, max_kernel_rows=None) for _ in range(2))
    kept.keep_dense()
    kept.dense(by_column=False)
    kept.pack_dense()
    return kept, codes


@needs_int4_kernel
def test_a_held_copy_multiplies_every_row_count_until_a_profile_says_the_kernel_wins(kept_weight):
    kept, codes = kept_weight
    for rows in (1, 3, 9):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(kept.linear(x), kept.held_copy_linear(x))
    set_kernel_over_kept_rows("cpu", "int4", 4)
    for rows in (1, 4):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(kept.linear(x), codes.linear(x))  # the kernel's product, bit for bit
        assert torch.equal(kept.linear(x), kept.kernel_linear(x))
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(kept.linear(x), kept.held_copy_linear(x))
    set_kernel_over_kept_rows("cpu", "int8", 64)  # another kernel's measure changes nothing here
    set_kernel_over_kept_rows("cpu", "int4", 0)
    x = torch.randn(1, 64).bfloat16()
    assert torch.equal(kept.linear(x), kept.held_copy_linear(x))


def test_the_profile_lets_the_kernel_take_rows_up_to_its_first_loss():
    speeds = DeviceSpeeds(kernel_over_kept_gains={"int4": {1: 1.9, 2: 1.8, 4: 1.4, 8: 0.9, 16: 1.2},
                                                  "int8": {1: 0.95, 2: 1.3}})
    assert speeds.kernel_over_kept_rows("int4") == 4  # 16 gains again, past a loss: not taken
    assert speeds.kernel_over_kept_rows("int8") == 0  # lost at the fewest rows
    assert speeds.kernel_over_kept_rows("none") == 0
    saved = HardwareProfile(devices={"cpu": speeds}).to_dict()
    back = HardwareProfile.from_dict(json.loads(json.dumps(saved)))
    assert back.compute.kernel_over_kept_gains == speeds.kernel_over_kept_gains


def test_a_kernel_over_kept_setting_names_a_kernel_and_a_row_count():
    with pytest.raises(ValueError, match="'int4' or 'int8'"):
        set_kernel_over_kept_rows("cpu", "int3", 4)
    with pytest.raises(ValueError, match=">= 0"):
        set_kernel_over_kept_rows("cpu", "int4", -1)
