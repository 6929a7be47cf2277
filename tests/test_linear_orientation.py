"""Decode-sized products as W x^T where this machine's profile measured it faster
(dense_linear.py): the same product, and the same generations, as F.linear's, for plain
weights and compressed weights' dense copies alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexgen_helm import dense_linear as linear_module
from flexgen_helm.dense_linear import NO_ROWS, flipped_linear, set_flipped_rows
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.models.linear import linear
from flexgen_helm.planner.hardware_profile import FLIPPED_ROW_COUNTS, DeviceSpeeds, HardwareProfile, use_profile
from flexgen_helm.policy import Policy


@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_flipped_product_is_f_linears_within_float32_rounding(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(40, 48, generator=g)
    bias = torch.randn(40, generator=g) if with_bias else None
    got, want = flipped_linear(x, w, bias), F.linear(x, w, bias)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_only_profiled_row_counts_of_the_profiled_dtype_take_it(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_module, "flipped_linear", lambda x, w, b=None: calls.append(len(x)) or F.linear(x, w, b))
    w = torch.randn(8, 4)
    for rows in (0, 1, 2, 7, 8, 16, 17):
        linear(torch.randn(rows, 4), w)
    set_flipped_rows("cpu", torch.float32, NO_ROWS)
    linear(torch.randn(0, 4), w)
    assert calls == []  # unprofiled, or no band: F.linear alone, an empty product too
    set_flipped_rows("cpu", torch.float32, (8, 16))
    for rows in (1, 2, 7, 8, 16, 17):
        linear(torch.randn(rows, 4), w)
    linear(torch.randn(8, 4, dtype=torch.bfloat16), w.bfloat16())
    assert calls == [8, 16]  # the band's ends included, nothing outside it, nor another dtype
    linear(torch.randn(8, 4), w.t().contiguous().t())  # stored by column: a CPU-packed weight's dense copy
    assert calls == [8, 16]  # F.linear's own layout: as W x^T it ran several times slower
    with pytest.raises(RuntimeError):  # a bias of another dtype is refused, as F.linear refuses it
        linear(torch.randn(4, 4), w, torch.zeros(8, dtype=torch.float64))
    for bad in ((1, 16), (16, 8), (0, 4)):
        with pytest.raises(ValueError, match="band of row counts"):
            set_flipped_rows("cpu", torch.float32, bad)


def test_the_profile_says_where_it_pays_and_the_cost_model_counts_it(tmp_path):
    from flexgen_helm.memory.machine import machine_info

    gains = {2: 1.9, 4: 2.7, 16: 1.5, 64: 1.02, 128: 1.3}  # 64 within noise: stop before it
    speeds = DeviceSpeeds(matmul_flops={"float32": {1: 1e10, 16: 4e10, 256: 1e11}}, flipped_gains={"float32": gains})
    assert speeds.flipped_rows("float32") == (2, 16) and speeds.flipped_rows("bfloat16") == NO_ROWS
    assert speeds.linear_flops("float32", 16) == pytest.approx(1.5 * 4e10)
    plain = DeviceSpeeds(matmul_flops=speeds.matmul_flops)
    assert speeds.linear_flops("float32", 64) == plain.linear_flops("float32", 64)
    assert speeds.linear_flops("float32", 128) == plain.linear_flops("float32", 128)  # past the first run: not taken
    path = HardwareProfile(devices={"cpu": speeds}, machine=machine_info()).save(tmp_path / "hardware.json")
    assert HardwareProfile.load(path).compute.flipped_gains == {"float32": gains}  # JSON keys back to ints
    use_profile(path)
    assert linear_module.FLIPPED_ROWS == {("cpu", torch.float32): (2, 16)}


def _grid(**gains) -> dict[int, float]:
    """Gains at every FLIPPED_ROW_COUNTS: those given (g8=1.2: 8 rows), 0.9 elsewhere."""
    return {rows: gains.get(f"g{rows}", 0.9) for rows in FLIPPED_ROW_COUNTS}


@pytest.mark.parametrize("gains, band", [
    # a 2-core AVX-512 Xeon (runs/bench/linear_orientation/results.jsonl): a loss at 2 rows and from 64
    ({2: 0.51, 4: 0.87, 8: 1.08, 16: 1.64, 32: 1.51, 48: 1.37, 64: 0.75, 96: 0.77, 128: 0.76}, (8, 48)),
    (_grid(g2=1.2, g8=1.2, g16=1.6, g32=1.4, g48=1.3), (8, 48)),  # the longest run, not the first
    (_grid(g2=1.2, g4=1.3, g16=1.6, g32=1.4), (2, 4)),  # two as long: the first
    (_grid(g64=1.2, g96=1.1, g128=1.3), (64, 128)),
    (_grid(), NO_ROWS),
    # a profile from before the band (one shape, 5 row counts): the run from its fewest rows, as then
    ({2: 1.9, 4: 2.7, 16: 1.5, 64: 1.02, 128: 1.3}, (2, 16)),
    ({2: 0.48, 4: 0.90, 16: 1.64, 64: 1.06, 128: 1.06}, NO_ROWS),  # the Xeon's, 06:19: nothing flipped then
])
def test_the_flipped_rows_are_the_longest_band_that_gains(gains, band):
    assert DeviceSpeeds(matmul_flops={"float32": {1: 1e10}}, flipped_gains={"float32": gains}).flipped_rows(
        "float32") == band
    if band != NO_ROWS:  # the cost model: a product inside the band gains, one just outside does not
        speeds = DeviceSpeeds(matmul_flops={"float32": {1: 1e10, 256: 1e11}}, flipped_gains={"float32": gains})
        plain = DeviceSpeeds(matmul_flops=speeds.matmul_flops)
        assert speeds.linear_flops("float32", band[0]) == pytest.approx(gains[band[0]] * plain.linear_flops(
            "float32", band[0]))
        assert speeds.linear_flops("float32", band[1] + 1) == plain.linear_flops("float32", band[1] + 1)


def test_a_compressed_weights_dense_copy_takes_it_too(monkeypatch):
    from flexgen_helm.compression.int4 import CompressedWeight
    from flexgen_helm.compression.quantize import quantize
    from flexgen_helm.policy.policy import Compression

    calls = []
    monkeypatch.setattr(linear_module, "flipped_linear", lambda *a: calls.append(1) or flipped_linear(*a))
    g = torch.Generator().manual_seed(0)
    q = quantize(torch.randn(32, 64, generator=g), Compression(4, 16, 1), 1)  # groups: dequantized, no kernel
    cw = CompressedWeight([(0, q)], (32, 64), torch.float32, 0)
    x = torch.randn(4, 64, generator=g)
    want = F.linear(x, cw.dense())
    set_flipped_rows("cpu", torch.float32, (2, 16))
    got = linear(x, cw)
    assert calls and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


SHARED = [7, 3, 12, 9, 5, 14, 2, 8, 11, 6, 4, 13] * 2  # at least MIN_SHARED_TOKENS


@pytest.mark.parametrize("prompts", [
    [[5, 9, 14, 3, 7], [8, 2, 11], [4, 4, 6, 10, 12, 1], [13, 3]],
    # a shared prefix held once for the block: its own prefill, decode attention in two parts
    [SHARED + [5, 9], SHARED + [8], SHARED + [4, 4, 6], SHARED + [13]],
], ids=["apart", "shared-prefix"])
def test_generations_are_the_same_either_way(tiny_llama, tmp_path, monkeypatch, prompts):
    """float32 greedy tokens equal, log-probs within float32 rounding, GPU batches of 2 rows
    (the decode step multiplies both batches' 4 rows together)."""
    calls = []
    monkeypatch.setattr(linear_module, "flipped_linear", lambda *a: calls.append(1) or flipped_linear(*a))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=2, num_gpu_batches=2), dtype="float32",
                         device="cpu", offload_dir=tmp_path, progress=False)
    runs = []
    for rows in (NO_ROWS, (2, 64)):
        set_flipped_rows("cpu", torch.float32, rows)
        run = engine.generate(prompts, params)
        runs.append(run.results)
        assert bool(calls) == (rows != NO_ROWS)  # the first run's products took F.linear, the second's W x^T
        if prompts[0][:len(SHARED)] == SHARED:
            assert run.stats.computed_prompt_tokens < run.stats.prompt_tokens  # the prefix ran once
    plain, flipped = ([c.completions[0] for c in run] for run in runs)
    assert [c.token_ids for c in plain] == [c.token_ids for c in flipped]
    for a, b in zip(plain, flipped):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_a_profile_from_before_the_orientation_measurement_says_so_once(tmp_path, caplog):
    from flexgen_helm.memory.machine import machine_info

    speeds = DeviceSpeeds(matmul_flops={"float32": {1: 1e10, 256: 1e11}})  # no flipped_gains: an older profile
    path = HardwareProfile(devices={"cpu": speeds}, machine=machine_info(),
                           measured_at="2026-01-02T03:04:05").save(tmp_path / "hardware.json")
    with caplog.at_level("WARNING"):
        assert use_profile(path) is not None
        assert use_profile(path) is not None
    told = [r.getMessage() for r in caplog.records if "flipped_gains" in r.getMessage()]
    assert len(told) == 1 and "2026-01-02T03:04:05" in told[0] and "flexgen-helm profile" in told[0]
    assert linear_module.FLIPPED_ROWS.get(("cpu", torch.float32), NO_ROWS) == NO_ROWS
    # a GPU's profile never measures them: nothing to say
    caplog.clear()
    gpu = HardwareProfile(devices={"cpu": speeds, "cuda": speeds}, compute_device="cuda", machine=machine_info(),
                          measured_at="2026-01-02T03:04:06").save(tmp_path / "gpu.json")
    with caplog.at_level("WARNING"):
        assert use_profile(gpu) is not None
    assert not [r for r in caplog.records if "flipped_gains" in r.getMessage()]


def test_a_profile_from_before_the_band_keeps_its_rule_and_says_so_once(tmp_path, caplog):
    from flexgen_helm.memory.machine import machine_info

    old = {2: 0.48, 4: 0.90, 16: 1.64, 64: 1.06, 128: 1.06}  # the Xeon's one-shape gains, 06:19
    speeds = DeviceSpeeds(matmul_flops={"float32": {1: 1e10, 256: 1e11}}, flipped_gains={"float32": old})
    path = HardwareProfile(devices={"cpu": speeds}, machine=machine_info(),
                           measured_at="2026-11-27T06:19:56").save(tmp_path / "hardware.json")
    with caplog.at_level("WARNING"):
        use_profile(path)
        use_profile(path)
    told = [r.getMessage() for r in caplog.records if "row counts" in r.getMessage()]
    assert len(told) == 1 and "2026-11-27T06:19:56" in told[0] and "flexgen-helm profile" in told[0]
    assert linear_module.FLIPPED_ROWS == {("cpu", torch.float32): NO_ROWS}  # not 16-128, where SmolLM2 lost
    caplog.clear()
    measured = HardwareProfile(devices={"cpu": DeviceSpeeds(matmul_flops=speeds.matmul_flops, flipped_gains={
        "float32": _grid(g16=1.6, g32=1.4)})}, machine=machine_info(), measured_at="2026-11-27T07:39:00")
    with caplog.at_level("WARNING"):
        use_profile(measured.save(tmp_path / "measured.json"))
    assert not caplog.records and linear_module.FLIPPED_ROWS == {("cpu", torch.float32): (16, 32)}


def test_orientation_gain_is_the_median_of_paired_calls(monkeypatch):
    """The gain of W x^T is the median over pairs of calls made back to back: a spell in which
    the machine runs at a tenth of its speed moves no median, over one call or over a pair."""
    from types import SimpleNamespace

    from flexgen_helm.planner import hardware_profile

    now, speed = [0.0], [1.0]
    monkeypatch.setattr(hardware_profile, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    calls = []

    def work(seconds):
        def run():
            calls.append(seconds)
            speed[0] = 0.1 if len(calls) in (4, 7, 8) else 1.0  # pair 1's fast side, all of pair 3
            now[0] += seconds / speed[0]
        return run

    assert hardware_profile.paired_ratio(work(3.0), work(1.0)) == pytest.approx(3.0)
    assert len(calls) == 12  # a warm-up of each, then five pairs
