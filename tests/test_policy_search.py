"""Cost model, LP policy search, hardware profile and `--policy auto` (fast: no profiling,
synthetic hardware profiles)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import save_tiny

from flexgen_helm.cli import build_parser, main
from flexgen_helm.cli.options import policy_from_args
from flexgen_helm.engine import Engine
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.opt import config_for_size
from flexgen_helm.planner.budget import planned_bytes
from flexgen_helm.planner.cost_model import TERMS, CostModel, Workload
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile, default_profile_path
from flexgen_helm.planner.search import (
    NF,
    Budgets,
    SearchOptions,
    default_budgets,
    search,
    shortfalls,
    solve_lp,
    time_rows,
)
from flexgen_helm.policy import Compression, Policy, Split
from flexgen_helm.tools.validation.refit import refit
from flexgen_helm.weights.registry import resolve

GIB = 2**30
OPT13 = config_for_size("1.3b")


def speeds(**kw) -> DeviceSpeeds:
    return DeviceSpeeds(**{"matmul_flops": {"bfloat16": {1: 2e9, 16: 30e9, 256: 200e9, 4096: 300e9}},
                           "int4_matmul_flops": {1: 2e9, 128: 100e9, 512: 120e9}, "int4_dequant_elems_per_s": 1e9,
                           **kw})


def cpu_profile(**kw) -> HardwareProfile:
    return HardwareProfile(devices={"cpu": speeds()}, memcpy_bytes_per_s=5e9, disk_read_bytes_per_s=1e9,
                           disk_write_bytes_per_s=5e8, cpu_mem_bytes=24 * GIB, cpu_available_bytes=20 * GIB,
                           disk_free_bytes=100 * GIB, **kw)


def gpu_profile() -> HardwareProfile:
    return HardwareProfile(compute_device="cuda", dtype="float16",
                           devices={"cpu": speeds(), "cuda": DeviceSpeeds({"float16": {1: 50e9, 4096: 100e12}},
                                                                          attn_prefill_flops=50e12,
                                                                          attn_decode_bytes_per_s=1e12)},
                           h2d_pinned_bytes_per_s=12e9, h2d_pageable_bytes_per_s=6e9, d2h_pinned_bytes_per_s=12e9,
                           d2h_pageable_bytes_per_s=6e9, disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=1e9,
                           gpu_mem_bytes=16 * GIB, cpu_mem_bytes=64 * GIB, cpu_available_bytes=60 * GIB,
                           disk_free_bytes=500 * GIB)


def test_lp_returns_valid_fractions():
    model = CostModel(OPT13, cpu_profile(), Workload(512, 32))
    res = solve_lp(model, Policy(4, 2), default_budgets(cpu_profile(), cpu=2 * GIB))
    assert res.status == 0
    x = res.x[:NF]
    assert all(-1e-9 <= f <= 1 + 1e-9 for f in x)
    for k in range(3):
        assert sum(x[3 * k:3 * k + 3]) == pytest.approx(1.0)
    assert x[2] > 0.1  # 2 GiB of RAM cannot hold 2.6 GB of weights: some go to disk


@pytest.mark.parametrize("profile,budgets", [
    (cpu_profile(), dict(cpu=2 * GIB)),
    (cpu_profile(), dict(cpu=3 * GIB, disk=1 * GIB)),
    (gpu_profile(), dict(gpu=1 * GIB, cpu=2 * GIB)),
])
def test_search_respects_budgets(profile, budgets):
    b = default_budgets(profile, **budgets)
    result = search(OPT13, profile, 256, 16, b, SearchOptions(max_gpu_batch_size=8, max_num_gpu_batches=4))
    assert not shortfalls(result.estimate, b)
    for phase in result.estimate.peak_bytes.values():
        if profile.is_cuda:
            assert phase["gpu"] <= budgets["gpu"] and phase["cpu"] <= budgets["cpu"]
        else:  # the gpu pool is host RAM here: both tiers come out of the cpu budget
            assert phase["gpu"] + phase["cpu"] <= budgets["cpu"]
        assert phase["disk"] <= budgets.get("disk", 100 * GIB)


def test_infeasible_names_tier_and_shortfall():
    with pytest.raises(PolicyError, match=r"cpu \(host RAM.*short by 0\.[0-9]+ GiB"):
        search(OPT13, cpu_profile(), 512, 32, default_budgets(cpu_profile(), cpu=GIB // 4))
    with pytest.raises(PolicyError, match=r"disk tier is short by 1\.[0-9]+ GiB"):
        search(OPT13, cpu_profile(), 512, 32, default_budgets(cpu_profile(), cpu=GIB, disk=GIB))


def test_more_gpu_memory_never_predicts_lower_throughput():
    prof, last = gpu_profile(), 0.0
    for gpu_gib in (0.5, 1, 2, 4, 8):
        b = default_budgets(prof, gpu=int(gpu_gib * GIB), cpu=8 * GIB)
        got = search(OPT13, prof, 256, 32, b, SearchOptions(max_gpu_batch_size=8, max_num_gpu_batches=4))
        assert got.estimate.throughput >= last * (1 - 1e-9)
        last = got.estimate.throughput


def test_compression_reduces_predicted_io():
    model = CostModel(OPT13, cpu_profile(), Workload(512, 32))
    plain = model.estimate(Policy(4, 1, weights=Split(0, 0, 1), cache=Split(0, 0, 1)))
    packed = model.estimate(Policy(4, 1, weights=Split(0, 0, 1), cache=Split(0, 0, 1),
                                   compress_weight=Compression(), compress_cache=Compression()))
    # 4 bits + a bf16 min and scale per 64 elements: 0.25 + 0.03 of the bytes
    assert packed.decode_terms["disk_cpu"] < 0.35 * plain.decode_terms["disk_cpu"]
    assert packed.prefill_terms["cpu_disk"] < 0.35 * plain.prefill_terms["cpu_disk"]
    # above the int4 kernel's crossover (a prefill's rows) the weights are dequantized: not free
    assert packed.prefill_terms["compute"] > plain.prefill_terms["compute"]
    assert packed.peak_bytes["decode"]["disk"] < 0.35 * plain.peak_bytes["decode"]["disk"]


def test_cost_terms_of_a_hand_computable_case():
    """One Llama block (GQA: 2 heads, 1 KV head of dim 4), weights on disk, CPU-only."""
    cfg = ModelConfig(family="llama", name="hand", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, ffn_size=16, max_seq_len=32)
    flat = DeviceSpeeds({"bfloat16": {1: 1e9}}, attn_prefill_flops=1e9, attn_decode_bytes_per_s=1e9,
                        dequant_elems_per_s=1e9, elementwise_elems_per_s=1e9, op_latency_s=0.0)
    prof = HardwareProfile(devices={"cpu": flat}, memcpy_bytes_per_s=1e9, disk_read_bytes_per_s=1e6,
                           disk_write_bytes_per_s=1e6, disk_read_latency_s=0.0)
    model = CostModel(cfg, prof, Workload(prompt_len=4, gen_len=3))
    policy = Policy(2, 1, weights=Split(0, 0, 1))
    block = [k for k, (layer, _) in enumerate(model.groups) if layer.kind == "block"][0]
    decode = model.phase_terms(policy, "decode")[block]
    # weights: norms 8 + 8, q 8x8, k 4x8, v 4x8, o 8x8, gate/up 16x8, down 8x16 = 592 bf16 = 1184 bytes
    assert decode["disk_cpu"] == pytest.approx(1184 / 1e6)
    # linears: 2 flops x 2 rows x 576 matrix elements; attention reads K, V of 2 units x 4 dims x
    # 2 bytes at the mean length 4 + 3/2 = 5.5; elementwise passes: 2 rows x (22 x 8 + 2 x 16);
    # the new token's K, V copied into the gpu-tier slot: a memcpy by the computing cores here
    elementwise = 22 * 8 + 2 * 16
    kv_store = 2 * 2 * 4 * 2
    assert decode["compute"] == pytest.approx((2 * 2 * 576 + 5.5 * 2 * 2 * 4 * 2 + 2 * elementwise + kv_store) / 1e9)
    assert decode["gpu_cpu"] == decode["cpu_gpu"] == decode["cpu_disk"] == 0.0
    prefill = model.phase_terms(policy, "prefill")[block]
    # prefill attention computes the full 4 x 4 scores for 2 sequences x 2 heads x dim 4
    assert prefill["compute"] == pytest.approx(
        (2 * 8 * 576 + 4 * 2 * 2 * 4 * 4 * 4 + 8 * elementwise + 4 * kv_store) / 1e9)
    est = model.estimate(policy)
    assert est.total_s == pytest.approx(est.prefill_s + 2 * est.decode_step_s)
    assert est.throughput == pytest.approx(2 * 3 / est.total_s)


def test_a_dense_cache_read_off_disk_is_attended_where_it_landed_unless_a_ring():
    """CPU-only, the hand case's block: a memory tier's cache is attended where it lies, and
    so is a dense one read off disk (KVCacheSlot.reads_in_place): no compute beyond the
    memory tiers'. A sliding window's ring read off disk is first copied into the buffers
    attention reads (the schedule's decode_unpack_cache), a memcpy of the bytes read by the
    computing cores."""
    flat = DeviceSpeeds({"bfloat16": {1: 1e9}}, attn_prefill_flops=1e9, attn_decode_bytes_per_s=1e9,
                        dequant_elems_per_s=1e9, elementwise_elems_per_s=1e9, op_latency_s=0.0)
    for window in (0, 16):  # a window past the cache's length: the same keys, read as a ring
        cfg = ModelConfig(family="llama", name="hand", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                          num_kv_heads=1, ffn_size=16, max_seq_len=32, sliding_windows=(window,))
        for memcpy in (1e9, 0.5e9):
            prof = HardwareProfile(devices={"cpu": flat}, memcpy_bytes_per_s=memcpy, disk_read_bytes_per_s=1e6,
                                   disk_write_bytes_per_s=1e6, disk_read_latency_s=0.0)
            model = CostModel(cfg, prof, Workload(prompt_len=4, gen_len=3))
            block = [k for k, (layer, _) in enumerate(model.groups) if layer.kind == "block"][0]
            caches = {"gpu": Split(1, 0, 0), "cpu": Split(0, 1, 0), "disk": Split(0, 0, 1)}
            compute = {tier: model.phase_terms(Policy(2, 1, weights=Split(0, 0, 1), cache=cache), "decode")[block]
                       ["compute"] for tier, cache in caches.items()}
            assert compute["cpu"] == compute["gpu"]
            # K and V of 1 KV head x 4 dims x 2 sequences, 2 bytes each, at the mean length 4 + 3/2
            read = 5.5 * 2 * 2 * 4 * 2
            assert compute["disk"] - compute["cpu"] == pytest.approx(read / memcpy if window else 0.0)


def test_disk_overlap_loss_interpolates_between_overlap_and_taking_turns():
    """CPU-only: with loss 0 a layer costs max(compute, disk), with loss 1 their sum (the
    cores take turns), and the profile's measured loss sits in between."""
    policy = Policy(4, 1, cache=Split(0, 0, 1))
    steps = {}
    for loss in (0.0, 0.5, 1.0):
        model = CostModel(OPT13, cpu_profile(disk_overlap_loss={"prefill": loss, "decode": loss}), Workload(256, 16))
        steps[loss] = model.estimate(policy).decode_step_s
    free = CostModel(OPT13, cpu_profile(), Workload(256, 16))
    terms = free.phase_terms(policy, "decode")
    assert steps[0.0] == pytest.approx(free.estimate(policy).decode_step_s)
    assert steps[1.0] == pytest.approx(sum(n * (t["compute"] + t["disk_cpu"] + t["cpu_disk"])
                                           for n, t in zip(free.counts, terms)))
    assert steps[0.0] < steps[0.5] < steps[1.0]
    # the LP reads each term as an affine function of the fractions: it must be one
    lossy = CostModel(OPT13, cpu_profile(disk_overlap_loss={"prefill": 0.7, "decode": 0.7}), Workload(256, 16))
    mixed = Policy(4, 1, cache=Split(0.7, 0, 0.3), activations=Split(0.6, 0.2, 0.2))
    base, slopes = time_rows(lossy, mixed, "decode")
    x = np.array([0, 0, 0, 0.7, 0, 0.3, 0.6, 0.2, 0.2])
    assert [lt[t] for lt in lossy.phase_terms(mixed, "decode") for t in TERMS] == pytest.approx(base + slopes @ x)
    # without overlap the terms are summed already: the loss changes nothing
    serial = replace(policy, overlap=False)
    assert CostModel(OPT13, cpu_profile(disk_overlap_loss={"decode": 1.0}), Workload(256, 16)).estimate(
        serial).decode_step_s == pytest.approx(free.estimate(serial).decode_step_s)


def test_profile_json_round_trip(tmp_path):
    prof = replace(gpu_profile(), time_scale={"decode.compute": 1.3}, offload_dir="/tmp/x")
    path = prof.save(tmp_path / "hw.json")
    assert HardwareProfile.load(path) == prof
    assert json.loads(path.read_text())["format"] == prof.format


def test_refit_scales_the_bottleneck_term(tmp_path):
    prof = cpu_profile()
    policy = Policy(4, 1, weights=Split(0, 0, 1))
    est = CostModel(OPT13, prof, Workload(128, 8)).estimate(policy)
    record = {"model": OPT13.name, "policy": policy.to_dict(), "prompt_len": 128, "gen_len": 8,
              "prefill_latency_s": 2 * max(est.prefill_terms.values()),
              "decode_latency_s": 7 * 0.5 * max(est.decode_terms.values())}
    (tmp_path / "run.json").write_text(json.dumps(record))
    fitted, report = refit(prof, [tmp_path / "run.json"])
    assert fitted.time_scale["decode.disk_cpu"] == pytest.approx(0.5)
    assert "decode" in report


def test_policy_auto_is_accepted_by_the_engine(tmp_path, capsys):
    path = save_tiny("opt", tmp_path / "tiny")
    cpu_profile().save(default_profile_path())  # a saved profile: no profiling in tests
    args = build_parser().parse_args(["generate", "--model", str(path), "--policy", "auto", "--prompt", "hello",
                                      "world!", "--max-new-tokens", "4", "--dtype", "float32"])
    policy = policy_from_args(args)
    assert isinstance(policy, Policy) and "planned policy" in capsys.readouterr().err
    assert policy.block_size <= 2  # two prompts: a bigger block would only pad
    engine = Engine.load(str(path), policy, dtype="float32", device="cpu", offload_dir=tmp_path, progress=False)
    out = engine.generate([[5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(max_new_tokens=4, ignore_eos=True)).results
    assert len(out[0].completions[0].token_ids) == 4


def test_a_rounding_that_falls_short_is_solved_again_though_all_on_disk_fits():
    """4 blocks of Qwen3-30B-A3B, 4-bit weights (1.75 GB), a 1.5 GiB pool and 1 GiB of RAM:
    the LP's placement falls short once rounded, and the all-on-disk variant fits; the search
    still solves again with the budget tightened and keeps the weights in RAM, the faster."""
    from flexgen_helm.models.moe import geometry

    cfg = replace(geometry("qwen3-30b-a3b"), num_layers=4)
    prof = cpu_profile()
    opts = SearchOptions(compress_weight=Compression(4, 64), max_gpu_batch_size=1, max_num_gpu_batches=1)
    found = search(cfg, prof, 24, 8, default_budgets(prof, int(1.5 * GIB), GIB), opts)
    on_disk = CostModel(cfg, prof, Workload(24, 8)).estimate(replace(found.policy, weights=Split(0, 0, 1)))
    assert found.policy.weights.disk == 0
    assert found.estimate.throughput > 1.2 * on_disk.throughput


def test_generate_plans_under_its_memory_budgets(capsys):
    """`generate --policy auto --cpu-mem ...` searches under the budgets given (a 30B
    mixture of experts in 24 GiB of RAM: issue 49); budgets beside a policy that leaves
    nothing to plan are refused, not ignored."""
    from flexgen_helm.cli.options import check_budgets_steer
    from flexgen_helm.errors import FlexGenError

    cpu_profile().save(default_profile_path())
    # bfloat16 on every CPU (the default is float32 where bf16 is emulated): the budgets below
    # are sized for its weights
    argv = ["generate", "--model", "facebook/opt-1.3b", "--dummy", "--policy", "auto", "--prompt", "hello",
            "--max-new-tokens", "4", "--dtype", "bfloat16"]
    roomy = policy_from_args(build_parser().parse_args(argv))
    tight = policy_from_args(build_parser().parse_args([*argv, "--gpu-mem", "512MiB", "--cpu-mem", "1GiB"]))
    assert roomy.weights.disk == 0 < tight.weights.disk
    pinned = build_parser().parse_args(["generate", "--prompt", "x", "--percent", "100", "0", "100", "0", "100", "0",
                                        "--gpu-batch-size", "1", "--num-gpu-batches", "1", "--cpu-mem", "1GiB"])
    with pytest.raises(FlexGenError, match="--cpu-mem steer the planner"):
        check_budgets_steer(pinned)


def test_search_command_prints_breakdown(tmp_path, capsys):
    prof = cpu_profile().save(tmp_path / "hw.json")
    rc = main(["search", "--model", "facebook/opt-1.3b", "--dummy", "--prompt-len", "128", "--gen-len", "8",
               "--cpu-mem", "2GiB", "--profile", str(prof), "--max-gpu-batch-size", "8", "--max-num-gpu-batches", "2",
               "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "bottleneck" in out and "disk_cpu" in out
    record = json.loads((tmp_path / "s.json").read_text())
    assert Policy.from_dict(record["policy"]).weights.disk > 0
    assert Budgets(cpu=1).constraints()[0][0] == "cpu"


def test_helm_plugin_accepts_policy_auto():
    from flexgen_helm.helm.engines import resolve_load_args
    from flexgen_helm.planner.auto import policy_for_model

    cpu_profile().save(default_profile_path())
    args = resolve_load_args("facebook/opt-125m", deployment="flexgen/opt-125m", dummy=True, policy="auto")
    assert args.auto and args.policy_json is None  # planned when the engine loads
    assert policy_for_model(args.model, dummy=True, auto=True).block_size >= 1


def test_saved_profile_of_other_hardware_is_remeasured(tmp_path, monkeypatch, capsys):
    from flexgen_helm.memory.machine import machine_info
    from flexgen_helm.planner import hardware_profile

    here = machine_info()
    fresh = HardwareProfile(machine=here, disk_read_bytes_per_s=7.0)
    monkeypatch.setattr(hardware_profile, "measure", lambda offload_dir=None: fresh)
    path = tmp_path / "hardware.json"
    HardwareProfile(machine={**here, "cpu": "Some Other CPU"}).save(path)
    assert hardware_profile.load_or_profile(path).disk_read_bytes_per_s == 7.0
    assert "measured on Some Other CPU" in capsys.readouterr().out
    HardwareProfile(machine=here, disk_read_bytes_per_s=3.0).save(path)  # this machine's: reused
    assert hardware_profile.load_or_profile(path).disk_read_bytes_per_s == 3.0


def test_ram_budgets_hold_the_process_itself_on_a_cpu_only_machine():
    """gpu pool + cpu budgets are host RAM: both tiers' peaks and the process's own memory
    (the profile's baseline) fit their sum, so RSS stays near the budgets the user gave."""
    prof = cpu_profile(process_baseline_bytes=int(0.3 * GIB))
    budgets = default_budgets(prof, gpu=GIB, cpu=2 * GIB)
    assert "host" in [name for name, _, _ in budgets.constraints()]
    est = search(OPT13, prof, 128, 8, budgets, SearchOptions(max_gpu_batch_size=16, max_num_gpu_batches=4)).estimate
    for peak in est.peak_bytes.values():
        assert peak["gpu"] + peak["cpu"] + prof.process_baseline_bytes <= 3 * GIB


@pytest.mark.parametrize("prompt_len,gen_len,gbs,nb", [(128, 128, 4, 32), (512, 32, 1, 32)])
def test_ram_that_weights_leave_goes_to_the_cache(prompt_len, gen_len, gbs, nb):
    """OPT-6.7B in a 1.5 GiB pool with 4 GiB of RAM on a CPU-only machine: the LP's share of
    weights in RAM does not fit once its split tensors are assembled, so they go to disk.
    The search then gives the RAM to the KV cache: it predicts no less than the same block
    with the cache placed by hand in the RAM the weights left."""
    opt67 = config_for_size("6.7b")
    budgets = default_budgets(cpu_profile(), gpu=int(1.5 * GIB), cpu=4 * GIB)
    result = search(opt67, cpu_profile(), prompt_len, gen_len, budgets,
                    SearchOptions(gpu_batch_size=gbs, num_gpu_batches=nb))
    model = CostModel(opt67, cpu_profile(), Workload(prompt_len, gen_len))
    on_disk = Policy(gbs, nb, weights=Split(0, 0, 1), activations=Split(0, 1, 0))
    by_hand = [model.estimate(replace(on_disk, cache=Split.from_percent(0, c))) for c in (10, 20, 30)]
    fitting = [est.throughput for est in by_hand if not shortfalls(est, budgets)]
    assert fitting, "no hand placement fits: the case no longer tests the RAM the weights leave"
    assert result.policy.weights.disk == 1.0
    assert result.estimate.throughput >= max(fitting)
    assert not shortfalls(result.estimate, budgets)


def test_among_near_equal_predictions_the_smallest_block_wins():
    """Scoring-like work (prefill only) with nothing binding: large blocks all predict about
    the same; the search takes the smallest of those within 2% of the best (less latency,
    memory and padding), never one predicted slower than that."""
    result = search(OPT13, cpu_profile(), 128, 1, default_budgets(cpu_profile()),
                    SearchOptions(max_gpu_batch_size=64, max_num_gpu_batches=8))
    best = result.candidates[0].estimate.throughput
    near = [c for c in result.candidates if c.estimate.throughput >= 0.98 * best]
    assert result.policy.block_size == min(c.policy.block_size for c in near)
    assert result.estimate.throughput >= 0.98 * best


def test_bench_admits_a_prefill_whose_hidden_states_fit(tiny_opt, tmp_path, capsys):
    """bench's budget check counts the activations the engine holds in memory, a prefill's
    (the prompt's positions), as the search plans them: a policy the search found for
    OPT-6.7B 128/128 with 4-bit weights was refused at 4.06 GiB of a 4 GiB cpu budget
    because the check sized them for prompt + generated tokens."""
    cfg = resolve(str(tiny_opt)).config
    policy = Policy(2, 1, weights=Split(1, 0, 0), cache=Split(1, 0, 0), activations=Split(0, 1, 0))
    prompt_len, gen_len = 8, 8
    need = planned_bytes(cfg, policy, prompt_len + gen_len, torch.float32, act_len=prompt_len)["cpu"]
    argv = ["bench", "--model", str(tiny_opt), "--device", "cpu", "--dtype", "float32", "--prompt-len",
            str(prompt_len), "--gen-len", str(gen_len), "--gpu-batch-size", "2", "--num-gpu-batches", "1",
            "--percent", "100", "0", "100", "0", "0", "100", "--offload-dir", str(tmp_path)]
    assert main([*argv, "--cpu-mem", str(need / GIB)]) == 0
    capsys.readouterr()
    assert main([*argv, "--cpu-mem", str((need - 64) / GIB)]) == 2
    assert "on the cpu tier" in capsys.readouterr().err


def test_bench_checks_a_given_policy_against_its_disk_budget(tiny_opt, tmp_path, capsys):
    """bench and search share their workload and budget flags; bench checks a given
    policy against all three budgets before loading anything."""
    rc = main(["bench", "--model", str(tiny_opt), "--device", "cpu", "--prompt-len", "8", "--gen-len", "2",
               "--percent", "0", "0", "100", "0", "100", "0", "--disk-mem", "1KiB", "--offload-dir", str(tmp_path)])
    assert rc == 2 and "on the disk tier" in capsys.readouterr().err
