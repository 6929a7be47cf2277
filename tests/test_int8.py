"""8-bit weights per output channel (group_size -1) and the int8 weight-only matmul: float32
runs compute with exactly the simulated quantization, the kernel agrees with the copy it is
checked against, every tier holds the packed bytes, and settings the grid does not take are
refused with their reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import fake_quantized_checkpoint

from flexgen_helm.compression.int4 import CompressedWeight
from flexgen_helm.compression.int8 import PackedInt8, dequantize_int8, int8_mm, pack_int8
from flexgen_helm.compression.quantize import dequantize, quantize
from flexgen_helm.engine import Engine
from flexgen_helm.errors import PolicyError
from flexgen_helm.policy import Policy, Split
from flexgen_helm.policy.policy import PER_CHANNEL, Compression

CHANNEL8 = Compression(bits=8, group_size=PER_CHANNEL)
PROMPTS = [[5, 17, 42, 7, 99], [3, 8, 1]]


def test_per_channel_weights_in_float32_are_the_simulated_quantization(tiny_llama, tmp_path):
    reference = Engine.load(str(fake_quantized_checkpoint(tiny_llama, tmp_path / "fq", CHANNEL8)), Policy(),
                            offload_dir=tmp_path / "r", device="cpu", dtype="float32", progress=False)
    policy = Policy(gpu_batch_size=2, weights=Split(0.3, 0.3, 0.4), compress_weight=CHANNEL8)
    engine = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path / "e", device="cpu", dtype="float32",
                         progress=False)
    for got, want in zip(engine.score(PROMPTS).results, reference.score(PROMPTS).results):
        assert got.logprobs[1:] == pytest.approx(want.logprobs[1:], abs=1e-5)
    groups = {h.compression.group_size == h.spec.shape[1] for h in engine.runtime.homes.values() if h.group_dim}
    assert groups == {True}  # one group per row, whatever the weight's input size


def test_the_kernel_computes_with_the_weights_its_dense_copy_holds():
    torch.manual_seed(0)
    w = torch.randn(192, 576, dtype=torch.bfloat16)
    p = pack_int8(quantize(w, CHANNEL8, 1), torch.bfloat16)
    assert p.packed.dtype == torch.int8 and p.scales.shape == (192,)
    dense = dequantize_int8(p, torch.float32)
    # the grid: per row, min/max 8-bit; scale and zero rounded once to bfloat16
    q = quantize(w, CHANNEL8, 1)
    want = dequantize(q, torch.float32)
    half_steps = (q.scale.float().abs() * 128 + (q.min.float() + 128 * q.scale.float()).abs()) * 2.0 ** -8
    assert bool(((dense - want).abs() <= half_steps * 1.001).all())
    for rows in (1, 5, 64):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        got, ref = int8_mm(x, p).float(), F.linear(x.float(), dense)
        assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()  # bfloat16 outputs, summed in the kernel
    # a lookup dequantizes the rows it needs, as the whole copy does
    cw = CompressedWeight([(0, p)], (192, 576), torch.bfloat16, max_kernel_rows=128)
    ids = torch.tensor([[3, 191], [0, 3]])
    assert torch.equal(cw.embedding(ids), F.embedding(ids, dequantize_int8(p, torch.bfloat16)))


def test_bfloat16_int8_weights_live_packed_on_every_tier(tiny_llama, tmp_path):
    results = []
    for split in (Split(1, 0, 0), Split(0.3, 0.3, 0.4)):
        policy = Policy(gpu_batch_size=2, weights=split, compress_weight=CHANNEL8)
        engine = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path / "o", device="cpu", dtype="bfloat16",
                             progress=False)
        homes = [h for h in engine.runtime.homes.values() if h.group_dim is not None]
        assert {h.layout for h in homes} == {"int8"}
        assert all(isinstance(d, PackedInt8) for h in homes for d in h.data if d is not None)
        results.append([r.logprobs for r in engine.score(PROMPTS).results])
    assert results[0] == results[1]  # placement never changes the numbers


@pytest.mark.parametrize("policy, message", [
    (dict(compress_cache=CHANNEL8), "is for weights"),
    (dict(compress_weight=Compression(8, PER_CHANNEL, method="gptq")), "takes rtn or hqq"),
    (dict(compress_weight=Compression(8, PER_CHANNEL, group_dim=0)), "groups along dim 1"),
    (dict(compress_weight=Compression(8, -2)), "group size must be positive"),
])
def test_settings_the_per_channel_grid_does_not_take_are_refused(policy, message):
    with pytest.raises(PolicyError, match=message):
        Policy(**policy)


def test_profiling_measures_the_int8_kernel_and_the_engine_takes_its_crossover(tiny_llama, tmp_path, monkeypatch):
    from flexgen_helm.compression import int8
    from flexgen_helm.memory.machine import machine_info
    from flexgen_helm.planner import hardware_profile
    from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile, use_profile

    monkeypatch.setattr(hardware_profile, "MATMUL_SHAPE", (256, 512))
    monkeypatch.setattr(hardware_profile, "STREAMED_WEIGHTS", 2)
    table, dequant = hardware_profile._int8_speeds(torch.device("cpu"), torch.bfloat16, None)
    assert sorted(table) == list(hardware_profile.KERNEL_ROWS) and min(table.values()) > 0 and dequant > 0
    assert hardware_profile._int8_speeds(torch.device("cpu"), torch.float32, None) == ({}, 0.0)
    # a profile whose int8 kernel beats dequantize-then-matmul up to 8 rows: decode rows take it
    bf16 = {1: 2e9, 8: 15e9, 32: 60e9, 128: 200e9, 512: 300e9}
    fast = {1: 6e9, 8: 45e9, 32: 20e9, 128: 30e9, 512: 40e9}
    cpu = DeviceSpeeds({"bfloat16": bf16}, int8_matmul_flops=fast, int8_dequant_elems_per_s=2e9)
    saved = HardwareProfile(devices={"cpu": cpu}, machine=machine_info()).save(tmp_path / "hardware.json")
    assert use_profile(saved) is not None and int8.MAX_KERNEL_ROWS["cpu"] == 8
    engine = Engine.load(str(tiny_llama), Policy(2, 1, compress_weight=CHANNEL8), dtype="bfloat16", device="cpu",
                         offload_dir=tmp_path, progress=False)
    block = next(layer for layer in engine.runtime.layers if layer.kind == "block")
    w = next(v for v in engine.runtime.load_layer(block).values() if isinstance(v, CompressedWeight))
    assert w.packed and w.uses_kernel(8) and not w.uses_kernel(9)
