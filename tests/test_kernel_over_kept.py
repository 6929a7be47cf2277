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
    set_kernel_over_kept_rows("cpu", "int4", torch.bfloat16, 4)
    for rows in (1, 4):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(kept.linear(x), codes.linear(x))  # the kernel's product, bit for bit
        assert torch.equal(kept.linear(x), kept.kernel_linear(x))
        assert not torch.equal(kept.linear(x), kept.held_copy_linear(x))  # the two paths' bits differ here
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(kept.linear(x), kept.held_copy_linear(x))
    set_kernel_over_kept_rows("cpu", "int8", torch.bfloat16, 64)  # another kernel's measure: nothing here
    set_kernel_over_kept_rows("cpu", "int4", torch.float16, 64)  # ... nor another dtype's
    set_kernel_over_kept_rows("cpu", "int4", torch.bfloat16, 0)
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
        set_kernel_over_kept_rows("cpu", "int3", torch.bfloat16, 4)
    with pytest.raises(ValueError, match=">= 0"):
        set_kernel_over_kept_rows("cpu", "int4", torch.bfloat16, -1)


@needs_int4_kernel
def test_the_profile_times_each_kernel_against_a_held_copy(monkeypatch):
    """`flexgen-helm profile`'s measurement, on small weights: a gain per kernel that runs
    here and row count, positive and finite."""
    from flexgen_helm.planner import hardware_profile

    monkeypatch.setattr(hardware_profile, "FLIPPED_STREAMED_BYTES", 1 << 20)
    monkeypatch.setattr(hardware_profile, "MATMUL_SHAPE", (256, 128))
    monkeypatch.setattr(hardware_profile, "FLIPPED_SMALL_SHAPE", (128, 64))
    monkeypatch.setattr(hardware_profile, "KEPT_KERNEL_ROWS", (1, 4))
    gains = hardware_profile._kernel_over_kept_gains(torch.device("cpu"), torch.bfloat16)
    assert set(gains) == {"int4", "int8"}
    for table in gains.values():
        assert set(table) == {1, 4} and all(0 < g < float("inf") for g in table.values())
    assert hardware_profile._kernel_over_kept_gains(torch.device("cpu"), torch.float32) == {}  # no kernel runs


def test_a_profile_without_the_measurement_leaves_no_held_copy_to_a_kernel(monkeypatch, tmp_path):
    from flexgen_helm.memory.machine import machine_info
    from flexgen_helm.planner.hardware_profile import use_profile

    monkeypatch.setattr(int4, "KERNEL_OVER_KEPT_ROWS", {})
    path = tmp_path / "hardware.json"
    measured = HardwareProfile(devices={"cpu": DeviceSpeeds(kernel_over_kept_gains={"int4": {1: 2.0, 8: 1.3}})},
                               machine=machine_info())
    path.write_text(json.dumps(measured.to_dict()))
    use_profile(path)
    assert int4.KERNEL_OVER_KEPT_ROWS == {("cpu", "int4", torch.bfloat16): 8}
    path.write_text(json.dumps(HardwareProfile(machine=machine_info()).to_dict()))
    use_profile(path)
    assert int4.KERNEL_OVER_KEPT_ROWS == {}
