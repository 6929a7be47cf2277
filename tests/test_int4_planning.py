"""The cost model and the policy search know the int4 kernel's speed by activation row count
(`flexgen-helm profile` measures it), so `--policy auto` knows when 4-bit weights pay; the
engine multiplies on the kernel up to the crossover that same profile measured. Synthetic
profiles: no profiling here, except one small measurement of the kernel itself."""

from __future__ import annotations

import json

import pytest
import torch

from flexgen_helm.compression import int4
from flexgen_helm.engine import Engine
from flexgen_helm.errors import ProfileFormatError
from flexgen_helm.executor.working_set import DEQUANTIZE_WORKING_BYTES, KEPT_WORKING_SETS
from flexgen_helm.memory.machine import machine_info
from flexgen_helm.models.opt import config_for_size
from flexgen_helm.planner import hardware_profile
from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile, use_profile
from flexgen_helm.planner.search import SearchOptions, default_budgets, search
from flexgen_helm.policy import Compression, Policy, Split

GIB = 2**30
OPT13 = config_for_size("1.3b")
W4 = Compression(4, 64)
# bf16 linears stream their weights at decode sizes (memory-bound), compute-bound above
BF16 = {1: 2e9, 8: 15e9, 32: 60e9, 128: 200e9, 512: 300e9}
# the kernel reads a quarter of the bytes: ~3x bf16 where both are memory-bound, slower than
# dequantize-then-matmul from 32 rows on (at 2 G elements/s: the crossover is 8 rows)
FAST_KERNEL = {1: 6e9, 8: 45e9, 32: 20e9, 128: 30e9, 512: 40e9}
SLOW_KERNEL = {r: f / 4 for r, f in BF16.items()}


def profile(kernel: dict[int, float], dequant: float = 2e9, **kw) -> HardwareProfile:
    cpu = DeviceSpeeds({"bfloat16": BF16}, int4_matmul_flops=kernel, int4_dequant_elems_per_s=dequant)
    return HardwareProfile(devices={"cpu": cpu}, memcpy_bytes_per_s=5e9, disk_read_bytes_per_s=1e9,
                           disk_write_bytes_per_s=5e8, cpu_mem_bytes=24 * GIB, cpu_available_bytes=20 * GIB,
                           disk_free_bytes=100 * GIB, **kw)


def test_the_crossover_is_where_the_kernel_stops_beating_dequantize_then_matmul():
    assert profile(FAST_KERNEL).compute.int4_kernel_max_rows("bfloat16") == 8
    assert profile(SLOW_KERNEL).compute.int4_kernel_max_rows("bfloat16") == 0
    # dequantizing is so slow that the kernel wins at every row count measured: it takes them all
    assert profile(SLOW_KERNEL, dequant=1e6).compute.int4_kernel_max_rows("bfloat16") is None
    assert profile({}).compute.int4_kernel_max_rows("bfloat16") == 0  # not measured: never


@pytest.mark.parametrize("kernel,faster", [(FAST_KERNEL, True), (SLOW_KERNEL, False)], ids=["fast", "slow"])
def test_4bit_decode_is_predicted_faster_than_bf16_only_where_the_kernel_is(kernel, faster):
    """Weights in RAM, 4 sequences per GPU batch (decode multiplies 4 rows, prefill 4 x 128):
    the model charges the kernel's profiled speed at 4 rows, so 4-bit decode beats bf16 when
    the kernel streams its quarter of the bytes faster; prefill (above the crossover)
    dequantizes and is slower either way."""
    model = CostModel(OPT13, profile(kernel), Workload(128, 32))
    in_ram = Policy(4, 1, weights=Split(0, 1, 0))
    bf16, w4 = model.estimate(in_ram), model.estimate(Policy(4, 1, weights=Split(0, 1, 0), compress_weight=W4))
    assert (w4.decode_step_s < bf16.decode_step_s) == faster
    assert w4.prefill_s > bf16.prefill_s
    assert model.kernel_takes(4) == faster and not model.kernel_takes(4 * 128)


def test_the_search_keeps_gpu_batches_within_the_kernels_crossover():
    """Decode-heavy work, blocks of up to 16 sequences. bf16 weights: one GPU batch of 16
    (the matmul's speed grows with its rows). 4-bit weights on a kernel that wins up to 8
    rows: GPU batches of at most 8, so decode stays on the kernel. A kernel that never wins:
    the dense copy, dequantized once per layer for the block, shared by one batch of 16."""
    fast, slow = profile(FAST_KERNEL), profile(SLOW_KERNEL)

    def searched(prof, compression):
        return search(OPT13, prof, 16, 64, default_budgets(prof),
                      SearchOptions(max_block_size=16, compress_weight=compression)).policy

    assert searched(fast, None).gpu_batch_size == 16
    assert searched(fast, W4).gpu_batch_size <= 8
    assert searched(slow, W4).gpu_batch_size == 16


def test_a_dense_copy_is_budgeted_only_where_the_kernel_does_not_take_the_rows():
    """The peak memory counts the dequantized copy of the layer in use (not of the one
    prefetched): in prefill (rows above the crossover) a block's weights, in decode (on the
    kernel) none: the token embedding and the position table (no packed layout at 2050 rows,
    so groups along its rows) dequantize only the rows they look up. In both phases the
    freed memory kept for reuse holds a block layer's dense copy and its dequantization's
    working copies, KEPT_WORKING_SETS times (executor/working_set.py)."""
    model = CostModel(OPT13, profile(FAST_KERNEL), Workload(128, 8))
    peak = model.estimate(Policy(4, 1, weights=Split(0, 1, 0), compress_weight=W4)).peak_bytes
    plain = model.estimate(Policy(4, 1, weights=Split(0, 1, 0))).peak_bytes
    h, f = OPT13.hidden_size, OPT13.ffn_size
    block = (4 * h * h + 2 * h * f) * 2
    kept = KEPT_WORKING_SETS * (block + DEQUANTIZE_WORKING_BYTES)
    assert peak["prefill"]["gpu"] - plain["prefill"]["gpu"] == block + kept
    assert peak["decode"]["gpu"] - plain["decode"]["gpu"] == kept


def test_a_profile_of_the_old_format_is_refused_with_what_to_do(tmp_path, monkeypatch, capsys):
    path = tmp_path / "hardware.json"
    old = {**profile(FAST_KERNEL).to_dict(), "format": "flexgen-helm-hardware/2", "machine": machine_info()}
    for speeds in old["devices"].values():
        del speeds["int4_matmul_flops"], speeds["int4_dequant_elems_per_s"]
    path.write_text(json.dumps(old))
    with pytest.raises(ProfileFormatError, match=r"hardware/2, without.*flexgen-helm profile --json"):
        HardwareProfile.load(path)
    assert use_profile(path) is None  # the engine keeps its defaults
    # where a profile is taken when needed (--policy auto), an old one is measured again, saying why
    fresh = profile(FAST_KERNEL, machine=machine_info())
    monkeypatch.setattr(hardware_profile, "measure", lambda offload_dir=None: fresh)
    assert hardware_profile.load_or_profile(path).compute.int4_matmul_flops == FAST_KERNEL
    told = capsys.readouterr().out
    assert f"of format flexgen-helm-hardware/2, without what {hardware_profile.FORMAT} measures" in told


def test_a_profile_without_kernel_speeds_cannot_plan_packed_weights():
    model = CostModel(OPT13, profile({}, dequant=0.0), Workload(128, 8))
    model.estimate(Policy(4, 1))  # bf16 weights need no kernel speeds
    with pytest.raises(ProfileFormatError, match="no speeds of it.*flexgen-helm profile"):
        model.estimate(Policy(4, 1, compress_weight=W4))


def test_the_engine_multiplies_on_the_kernel_up_to_the_profiled_crossover(tiny_opt, tmp_path):
    path = profile(FAST_KERNEL, machine=machine_info()).save(tmp_path / "hardware.json")
    assert use_profile(path) is not None and int4.MAX_KERNEL_ROWS["cpu"] == 8
    policy = Policy(2, 1, compress_weight=Compression(4, 32))
    engine = Engine.load(str(tiny_opt), policy, dtype="bfloat16", device="cpu", offload_dir=tmp_path, progress=False)
    block = next(layer for layer in engine.runtime.layers if layer.kind == "block")
    fc1 = engine.runtime.load_layer(block)["fc1.weight"]
    assert fc1.packed and fc1.uses_kernel(8) and not fc1.uses_kernel(9)


def test_profiling_measures_the_kernel_at_every_row_bucket(monkeypatch):
    monkeypatch.setattr(hardware_profile, "MATMUL_SHAPE", (256, 512))
    monkeypatch.setattr(hardware_profile, "STREAMED_WEIGHTS", 2)
    table, dequant = hardware_profile._int4_speeds(torch.device("cpu"), torch.bfloat16, None)
    if int4.device_refusal(torch.bfloat16, torch.device("cpu")) is not None:
        pytest.skip("this CPU's int4 layout is not the one the engine decodes: the kernel is not profiled")
    assert sorted(table) == list(hardware_profile.KERNEL_ROWS) and min(table.values()) > 0 and dequant > 0
    # where the kernel cannot compute (float32), nothing is measured and the cost model never picks it
    assert hardware_profile._int4_speeds(torch.device("cpu"), torch.float32, None) == ({}, 0.0)


def test_a_kept_block_is_predicted_faster_where_the_profile_measured_the_kernel_beating_its_copies():
    """A block keeping its dense copies multiplies on the codes at a decode step's few rows
    where the profile measured the kernel faster than a held copy (kernel_over_kept_gains):
    the cost model charges those rows the kernel's speed, and nothing changes past them."""
    def kept_decode_s(gains: dict, rows: int) -> float:
        hw = profile(FAST_KERNEL)
        hw.compute.kernel_over_kept_gains = gains
        kept = Policy(rows, 1, weights=Split(0, 1, 0), compress_weight=W4, keep_dense_weights=True)
        return CostModel(OPT13, hw, Workload(128, 32)).estimate(kept).decode_step_s

    gains = {"int4": {1: 2.4, 2: 2.3, 4: 1.7, 8: 1.2, 16: 0.7}}
    assert profile(FAST_KERNEL).compute.kernel_over_kept_gain("int4", 4) == 1.0  # not measured
    assert kept_decode_s(gains, 4) < kept_decode_s({}, 4)
    assert kept_decode_s(gains, 16) == kept_decode_s({}, 16)  # past its first loss: the copies
    assert kept_decode_s({"int8": {1: 3.0, 4: 3.0}}, 4) == kept_decode_s({}, 4)  # another kernel's gain
