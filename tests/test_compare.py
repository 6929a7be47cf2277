"""`flexgen-helm compare` end to end on OPT-125M (dummy weights, tiny workload): the harness
produces complete rows for our engine and for HF accelerate with disk offload, and both
systems generate the same greedy tokens from the same exported weights in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from dataclasses import replace

import pandas as pd

from flexgen_helm.engine import Engine
from flexgen_helm.errors import FlexGenError, PolicyError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_info
from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile, load_or_profile
from flexgen_helm.policy.policy import Policy, Split
from flexgen_helm.tools.compare import accelerate_offload, run, table
from flexgen_helm.tools.compare.disk import measure_read_bandwidth
from flexgen_helm.tools.compare.ours import BudgetCheck, deepspeed_policy
from flexgen_helm.tools.compare.roofline import Roofline
from flexgen_helm.tools.compare.run import run_compare, with_measured_disk
from flexgen_helm.tools.compare.workloads import SETUPS, prompts
from flexgen_helm.weights.registry import resolve

TINY = SETUPS["tiny"]
GIB = 2**30


@pytest.fixture(autouse=True)
def _work_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FLEXGEN_HELM_COMPARE_DIR", str(tmp_path_factory.getbasetemp() / "compare-work"))


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> str:
    """A hand-made profile of this machine (measuring one takes minutes on shared cores)."""
    speeds = DeviceSpeeds({"bfloat16": {1: 2e9, 16: 30e9, 256: 200e9, 4096: 300e9}})
    prof = HardwareProfile(devices={"cpu": speeds}, disk_read_bytes_per_s=1e9, disk_device_read_bytes_per_s=1e9,
                           cpu_mem_bytes=24 * GIB, cpu_available_bytes=20 * GIB, disk_free_bytes=100 * GIB,
                           process_baseline_bytes=0, machine=machine_info())
    return str(prof.save(tmp_path_factory.mktemp("profile") / "hardware.json"))


# what measure_read_bandwidth returns, for runs that stop before reading anything
ONE_GB_S = {"device_read_bytes_per_s": 1e9, "engine_read_bytes_per_s": 1e9,
            "read_bytes_per_s": {"direct_1": 1e9, "direct_in_flight": 1e9}}


@pytest.fixture(scope="module")
def bandwidth(tmp_path_factory):
    return measure_read_bandwidth(tmp_path_factory.mktemp("bw"), nbytes=64 << 20, repeats=1)


@pytest.mark.parametrize("speed_check", [True, False])
def test_harness_rows(tmp_path, bandwidth, profile_path, monkeypatch, speed_check):
    def half_speed(profile):  # the machine multiplies at half its profiled speed just before each row
        assert speed_check, "the speed was checked without --speed-check"
        return 100e9, 200e9

    monkeypatch.setattr(run, "matmul_flops_now", half_speed)
    rows, ablations, commands = run_compare(TINY, tmp_path / "out", warmup=0, timeout_s=300,
                                            systems=("ours-deepspeed-policy", "hf-accelerate"), bandwidth=bandwidth,
                                            ablations=False, profile_path=profile_path, speed_check=speed_check)
    assert [r["system"] for r in rows] == ["ours-deepspeed-policy", "hf-accelerate"] and ablations == []
    assert len(commands) == 2 and "flexgen_helm.tools.compare.accelerate_offload" in commands[1]
    for r in rows:
        assert r["throughput_tok_s"] > 0 and r["effective_batch"] >= 1, r
        assert r["disk_weight_gib"] > 0 and r["disk_read_gib"] > 0 and r["roofline_tok_s"] > 0, r
        assert "disk" in r["weights_read_from"] and r["loadavg_1m"] is not None and "cores" in r["host"]
        assert r["peak_rss_gib"] > 0 and r["rss_limit_gib"] == round((256 + 160 + 512) / 1024, 2), r
        assert r["disk_device_gb_s"] > 0
    ours, acc = rows
    assert ours["predicted_tok_s"] > 0 and acc["predicted_tok_s"] is None  # the cost model predicts ours only
    # predicted with the disk speed this run measured (the bandwidth it was given), not the saved one,
    # and with the speed check the compute terms twice the profile's: the speed measured before the row
    policy_file = tmp_path / "out" / TINY.name / "ours-deepspeed-policy.policy.json"
    policy = Policy.from_dict(json.loads(policy_file.read_text()))
    profile = with_measured_disk(load_or_profile(profile_path), bandwidth)
    if speed_check:
        profile = replace(profile, time_scale={"prefill.compute": 2.0, "decode.compute": 2.0})
    assert ours["compute_time_scale"] == (2.0 if speed_check else None)
    model = CostModel(resolve(TINY.model, dummy=True).config, profile, Workload(TINY.prompt_len, TINY.gen_len),
                      torch.bfloat16)
    assert ours["predicted_tok_s"] == round(model.estimate(policy).throughput, 4)
    assert "O_DIRECT" in ours["weights_read_from"] and "evicted before every token" in acc["weights_read_from"]
    assert acc["vs_accelerate"] == 1.0 and ours["vs_accelerate"] > 0
    assert ours["effective_batch"] == acc["effective_batch"]  # same device budget, same row-by-row batch
    table.write(tmp_path / "md", rows, "t", [], commands)
    assert "vs_accelerate" in (tmp_path / "md" / "README.md").read_text()
    assert table.from_csv((tmp_path / "md" / "results.csv").read_text())[1]["system"] == "hf-accelerate"


def test_greedy_tokens_agree_with_accelerate_in_float32(tmp_path):
    """A real cross-check: the same exported weights, offloaded by each system its own way."""
    acc = accelerate_offload.run(TINY, batch=2, evict_each_token=False, hf_dtype="float32")
    assert "disk" in acc["device_map"].values()  # accelerate really offloaded part of the model
    policy = Policy(gpu_batch_size=1, num_gpu_batches=2, weights=Split(0.2, 0.3, 0.5))
    engine = Engine.load(TINY.model, policy, dummy=True, dtype="float32", device="cpu",
                         offload_dir=tmp_path, progress=False)
    ids = prompts(TINY, 2, engine.config.vocab_size)
    ours = engine.generate(ids, SamplingParams(max_new_tokens=TINY.gen_len, ignore_eos=True)).results
    assert [r.completions[0].token_ids for r in ours] == acc["generated_token_ids"]


def test_auto_row_and_its_ablations_from_one_run(tmp_path, bandwidth, profile_path):
    """The searched policy runs, its prediction is recorded, and the ablations are derived from
    it: each a real run, or a row saying why it would repeat the searched one."""
    rows, ablations, commands = run_compare(TINY, tmp_path / "out", warmup=0, timeout_s=300, systems=("ours-auto",),
                                            bandwidth=bandwidth, ablations=True, profile_path=profile_path)
    (auto,) = rows
    assert auto["throughput_tok_s"] > 0 and auto["predicted_tok_s"] > 0 and auto["rss_within_limit"] is not None
    labels = [r["label"] for r in ablations]
    assert labels[0].startswith("all optimizations") and ablations[0]["throughput_tok_s"] == auto["throughput_tok_s"]
    assert labels[1:] == ["no overlap", "no CPU compute", "row-by-row schedule", "no policy search"]
    for r in ablations[1:]:
        assert r.get("throughput_tok_s") or r["weights_read_from"].startswith("same as all optimizations"), r
    assert ablations[0]["vs_all_optimizations"] == 1.0
    assert len(commands) == 1 + sum(1 for r in ablations[1:] if r.get("throughput_tok_s"))


def test_compare_fails_loudly_when_the_search_finds_nothing(tmp_path, profile_path):
    """Budgets too small for one sequence: the search's error, with the tier and shortfall, before
    anything runs; no row benchmarks some other policy in its place."""
    starved = replace(TINY, name="starved", gpu_mem="1MiB", cpu_mem="1MiB")
    with pytest.raises(PolicyError, match=r"tier is short by"):
        run_compare(starved, tmp_path / "out", warmup=0, timeout_s=300, systems=("ours-auto",),
                    bandwidth=ONE_GB_S, ablations=False, profile_path=profile_path)
    assert not (tmp_path / "out").exists()


def test_the_flexgen_reference_rows_run_offline_on_gpu_setups_only(tmp_path, profile_path):
    """FlexGen's flex_opt asks the hub for OPT-30B's tokenizer: the stand-in saved under that
    name serves it offline, left-padded as flex_opt asks; its log's numbers are read, a log
    without them is an error; a CPU setup refuses the rows before any work."""
    from flexgen_helm.models.tokenizer import import_transformers
    from flexgen_helm.tools.compare.flexgen_reference import TOKENIZER_NAME, offline_tokenizer_cache, parse_log

    hub = offline_tokenizer_cache(SETUPS["opt-6.7b-p512-g32-gpu16"])
    tok = import_transformers().AutoTokenizer.from_pretrained(TOKENIZER_NAME, padding_side="left", cache_dir=hub,
                                                              local_files_only=True)
    ids = tok(["Paris is"], padding="max_length", max_length=12).input_ids[0]
    assert len(ids) == 12 and ids[:3] == [tok.pad_token_id] * 3 and ids[3] == 2  # OPT's </s> first
    log = ("model size: 12.386 GB\tcache size: 0.570 GB\thidden size (p): 0.016 GB\n"
           "peak gpu mem: 13.400 GB\tprojected: False\n"
           "prefill latency: 0.512 s\tprefill throughput: 2000.000 token/s\n"
           "decode latency: 1.234 s\tdecode throughput: 50.243 token/s\n"
           "total latency: 1.746 s\ttotal throughput: 36.655 token/s")
    got = parse_log(log)
    assert (got["prefill_latency_s"], got["total_throughput"], got["peak_gpu_mem_gb"]) == (0.512, 36.655, 13.4)
    with pytest.raises(ValueError, match="total latency"):
        parse_log(log.rsplit("\n", 1)[0])
    with pytest.raises(FlexGenError, match="GPU setup"):
        run_compare(TINY, tmp_path, 0, 60, ("flexgen-reference",), profile_path=profile_path)
    assert not any(tmp_path.iterdir())


def test_weights_go_to_ram_whole_when_the_budgets_hold_them_there():
    """Near the device budget a split between RAM and disk stages both ways onto the device, so
    the fit is not monotone in the RAM share: all in RAM fits, half does not. The row-by-row
    policy then keeps every weight in RAM (a bisection from the middle put all of them on
    disk: OPT-6.7B with a 16 GiB GPU, runs/gpu/h100-2026-11-26)."""
    from flexgen_helm.tools.compare.ours import most_weights_in_ram

    def fits_all_or_nothing(policy):
        return policy.weights.cpu in (0.0, 1.0)

    row = Policy(gpu_batch_size=36, weights=Split(0, 0, 1))
    assert most_weights_in_ram(fits_all_or_nothing, row, use_gpu=False).weights == Split(0, 1, 0)
    assert most_weights_in_ram(lambda p: p.weights.cpu <= 0.37, row, use_gpu=False).weights == Split(0, 0.37, 0.63)


def test_row_by_row_policy_is_held_to_the_searchs_budgets(tmp_path, profile_path):
    """The DeepSpeed-style row is sized by the same accounting as --policy auto (loaded weights
    and working set included), not by stored bytes alone: its block is the largest that fits,
    and where none fits the row says so instead of running over the budgets."""
    profile = load_or_profile(profile_path)
    longer = replace(TINY, prompt_len=256, max_batch=8)  # a KV cache that weighs next to the weights
    batches = []
    for pool in ("256MiB", "224MiB"):
        setup = replace(longer, gpu_mem=pool)
        policy = deepspeed_policy(setup, profile)
        fits = BudgetCheck(setup, profile)
        assert fits(policy) and policy.num_gpu_batches == 1 and policy.cache.gpu == 1
        assert not fits(replace(policy, gpu_batch_size=policy.gpu_batch_size + 1))
        batches.append(policy.gpu_batch_size)
    assert batches[0] > batches[1] >= 1
    # a pool that holds the loaded weights and working set of one sequence's compute, but not them
    # and a row-by-row block's KV cache besides
    starved = replace(longer, name="pool", gpu_mem="176MiB")
    (row,), _, commands = run_compare(starved, tmp_path / "out", warmup=0, timeout_s=300,
                                      systems=("ours-deepspeed-policy",), bandwidth=ONE_GB_S,
                                      ablations=False, profile_path=profile_path)
    assert row["weights_read_from"].startswith("does not fit:") and "row by row" in row["weights_read_from"]
    assert commands == [] and row.get("throughput_tok_s") is None


def test_predictions_and_search_use_the_disk_speed_measured_at_the_runs_start(profile_path):
    """A saved profile's disk speed goes stale on a disk that speeds up and slows down (a shared
    VM's: 2.5 GB/s in a day-old profile, 1.25 at the run): compare plans and predicts with the
    speed it measured at its start, so a disk-bound row is predicted for the disk it runs on."""
    profile = load_or_profile(profile_path)
    slow = {"device_read_bytes_per_s": 0.25e9, "engine_read_bytes_per_s": 0.2e9,
            "read_bytes_per_s": {"direct_1": 0.15e9, "direct_in_flight": 0.2e9, "mmap": 0.25e9}}
    measured = with_measured_disk(profile, slow)
    assert (measured.disk_read_bytes_per_s, measured.disk_device_read_bytes_per_s) == (0.2e9, 0.25e9)
    assert measured.disk_read_modes == slow["read_bytes_per_s"] and measured.devices == profile.devices
    cfg = resolve(TINY.model, dummy=True).config
    on_disk = Policy(gpu_batch_size=1, num_gpu_batches=1, weights=Split(0, 0, 1))
    predicted = [CostModel(cfg, p, Workload(TINY.prompt_len, TINY.gen_len), torch.bfloat16).estimate(on_disk).throughput
                 for p in (profile, measured)]
    assert predicted[1] < predicted[0]


def test_roofline_and_ratio_arithmetic():
    """4 sequences, 2 GiB on disk read at 1 GiB/s: at most 2 tokens a second; 1 token/s is 50%."""
    ours = {"effective_batch_size": 4, "gen_len": 8, "prefill_latency_s": 2.0, "decode_latency_s": 30.0,
            "total_latency_s": 32.0, "total_throughput": 1.0, "disk_read_bytes": 16 * 2**30,
            "memory": {"placement": {"weight_bytes": {"disk": 2 * 2**30}}, "disk_page_cache_bypass": "O_DIRECT",
                       "cpu_peak_rss_bytes": 2**30}}
    acc = {**ours, "system": "hf-accelerate", "total_throughput": 0.25, "disk_weight_bytes": 2 * 2**30,
           "page_cache": {"evict_each_token": True}}
    roof = Roofline(prefill_s=2.0, decode_step_s=2.0, prefill_bound="disk", decode_bound="disk", total_s=16.0,
                    tokens_per_s=2.0)
    ctx = {"roofline": roof, "rss_limit_bytes": 2**30 + 2**29, "loadavg": 0.5}
    rows = [table.row("s", "ours", ours, ctx), table.row("s", "hf-accelerate", acc, ctx)]
    table.add_ratios(rows)
    assert rows[0]["roofline_tok_s"] == 2.0 and rows[0]["pct_of_roofline"] == 50.0
    assert rows[0]["disk_reads_per_token"] == 1.0 and rows[0]["vs_accelerate"] == 4.0
    assert rows[0]["rss_within_limit"] is True and rows[0]["peak_rss_gib"] == 1.0


def test_roofline_takes_the_slower_of_compute_and_disk_per_phase():
    """OPT-125M, 2 sequences of 8 tokens + 4 new at a flat 1 TFLOP/s; 1 GB on disk at 1 GB/s:
    prefill is the disk's second, a decode step too (its matmuls are microseconds)."""
    from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token
    from flexgen_helm.tools.compare.roofline import roofline
    from flexgen_helm.weights.registry import resolve

    cfg = resolve("facebook/opt-125m", dummy=True).config
    prof = HardwareProfile(devices={"cpu": DeviceSpeeds({"bfloat16": {1: 1e12}})})
    r = roofline(cfg, prof, "bfloat16", 2, 1, 8, 4, 1e9, 1e9)
    assert (r.prefill_s, r.decode_step_s, r.prefill_bound, r.decode_bound) == (1.0, 1.0, "disk", "disk")
    assert r.tokens_per_s == pytest.approx(2 * 4 / 4.0)
    # 1.2 GB of KV cache on disk at full length (12 positions): a decode step reads it as long as the
    # sequences are on average (8 + 4 / 2 = 10 positions), the prefill does not
    r = roofline(cfg, prof, "bfloat16", 2, 1, 8, 4, 1e9, 1e9, disk_cache_bytes=1.2e9)
    assert (r.prefill_s, r.decode_step_s) == (1.0, pytest.approx(2.0))
    r = roofline(cfg, prof, "bfloat16", 2, 1, 8, 4, 0.0, 1e9)  # nothing on disk: compute alone
    width = cfg.num_heads * cfg.head_dim
    assert r.prefill_s == pytest.approx(2 * (2 * matmul_params_per_token(cfg) * 8 + 2 * 64 * width * 12) / 1e12)


def test_roofline_reads_a_cpu_runs_weights_and_cache_in_ram_at_twice_the_memcpy_rate():
    """A CPU run's roof on RAM: 2 GB of OPT-125M's weights (the head tied to the embedding: all
    read every pass) at 2 x a 1 GB/s memcpy make a 1-second prefill and decode step, where its
    matmuls at 1 TFLOP/s take milliseconds; 1.2 GB of cache at full length (12 positions) adds
    what a step reads of it as long as the sequences are on average (10 positions)."""
    from flexgen_helm.tools.compare.roofline import roofline
    from flexgen_helm.weights.registry import resolve

    cfg = resolve("facebook/opt-125m", dummy=True).config
    prof = HardwareProfile(devices={"cpu": DeviceSpeeds({"bfloat16": {1: 1e12}})}, memcpy_bytes_per_s=1e9)
    r = roofline(cfg, prof, "bfloat16", 2, 1, 8, 4, 0.0, 1e9, ram_weight_bytes=2e9)
    assert (r.prefill_s, r.decode_step_s, r.prefill_bound, r.decode_bound) == (1.0, 1.0, "memory", "memory")
    r = roofline(cfg, prof, "bfloat16", 2, 1, 8, 4, 0.0, 1e9, ram_weight_bytes=2e9, ram_cache_bytes=1.2e9)
    assert (r.prefill_s, r.decode_step_s) == (1.0, pytest.approx(1.5))


def test_a_cpu_rows_ram_cache_counts_a_sliding_window_layer_at_its_window():
    """The RAM roof's cache: a block of 2 sequences at 12 positions, 1 KV head of 4 dims in bf16,
    on the gpu and cpu tiers (the disk's part left out); a layer with a window of 4 keeps 4
    positions; the weights as the record placed them in RAM (both tiers: a CPU's RAM); a GPU's
    rows have no RAM roof."""
    from flexgen_helm.models.config import ModelConfig
    from flexgen_helm.tools.compare.roofline import ram_resident

    cfg = ModelConfig(family="llama", name="w", vocab_size=16, hidden_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=1, ffn_size=16, max_seq_len=32, sliding_windows=(4, 0))
    record = {"memory": {"placement": {"weight_bytes": {"gpu": 100, "cpu": 20, "disk": 7}}}}
    policy = Policy(2, 1, cache=Split(0.5, 0.25, 0.25))
    cpu = HardwareProfile(devices={"cpu": DeviceSpeeds({"bfloat16": {1: 1e12}})})
    got = ram_resident(cfg, cpu, policy, record, 2, 12, torch.bfloat16)
    per_position = 2 * 2 * 1 * 4 * 2  # K and V, 2 sequences, 1 head, 4 dims, 2 bytes
    assert got == {"ram_weight_bytes": 120, "ram_cache_bytes": pytest.approx((4 + 12) * per_position * 0.75)}
    assert ram_resident(cfg, replace(cpu, compute_device="cuda"), policy, record, 2, 12, torch.bfloat16) == {}


def test_an_moe_pass_reads_the_experts_its_tokens_choose():
    """OLMoE-1B-7B (64 experts, 8 a token, its embedding apart from its head): one token reads
    its active parameters' share of all the weights (counted from the layers' tensors); 16
    tokens read ~56 experts a layer; a large block every expert, the embedding table still not."""
    from flexgen_helm.models import family_of
    from flexgen_helm.models.moe import expected_experts_touched
    from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token
    from flexgen_helm.tools.compare.roofline import weights_read_share
    from flexgen_helm.weights.registry import resolve

    cfg = resolve("allenai/olmoe-1b-7b-0924", dummy=True).config
    every = sum(t.numel for layer in family_of(cfg).layer_specs(cfg) for t in layer.tensors)
    assert weights_read_share(cfg, 1) == pytest.approx(matmul_params_per_token(cfg) / every, rel=1e-3)
    assert 55 < expected_experts_touched(64, 8, 16) < 57
    assert weights_read_share(cfg, 1) < weights_read_share(cfg, 16) < weights_read_share(cfg, 10**6)
    embedding = cfg.vocab_size * cfg.hidden_size
    assert weights_read_share(cfg, 10**6) == pytest.approx(1 - embedding / every, rel=1e-3)


@pytest.mark.parametrize("fixture", ["tiny_opt", "tiny_llama"])
def test_compute_floor_counts_every_matmul_weight(fixture, request):
    """The floor's weights per token are the model's Linear weights (the head included)."""
    from conftest import hf_model

    from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile
    from flexgen_helm.tools.compare.compute_floor import compute_floor, matmul_params_per_token
    from flexgen_helm.weights.registry import resolve

    path = request.getfixturevalue(fixture)
    model = hf_model(path)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = resolve(str(path)).config
    assert matmul_params_per_token(cfg) == linear
    prof = HardwareProfile(devices={"cpu": DeviceSpeeds({"bfloat16": {1: 1e9, 256: 4e9}})})
    f = compute_floor(cfg, [10, 20], prof)
    width = cfg.num_heads * cfg.head_dim
    assert f.seconds == pytest.approx((2 * linear * 30 + 2 * (100 + 400) * width * cfg.num_layers) / 4e9)


def test_helm_client_rows_compare_within_one_host():
    from flexgen_helm.tools.compare.helm_clients import agreement, findings

    def row(host, system, dtype, wall, correct):
        return {"host": host, "system": system, "dtype": dtype, "scenario": "lambada", "instances": 500,
                "wall_s": wall, "prefix_exact_match": correct / 500, "perplexity": None, "bits_per_byte": None}
    df = pd.DataFrame([row("A", "hf-float32", "float32", 200.0, 141), row("A", "ours", "bfloat16", 40.0, 142),
                       row("B", "hf-float32", "float32", 600.0, 141), row("B", "ours", "float32", 300.0, 141)])
    out = agreement(df).set_index(["host", "system"])
    assert out.speedup_vs_hf_float32[("A", "ours")] == 5.0  # against host A's HELM client, not B's
    assert out.speedup_vs_hf_float32[("B", "ours")] == 2.0
    assert out.correct_delta[("A", "ours")] == 1
    text = "\n".join(findings(agreement(df), Path("/nonexistent")))
    assert "lambada, 500 instances, B" in text and "same dtype (float32): `ours` is 2.00x" in text
    assert "accuracy: largest difference from hf-float32 1 instance(s)" in text


def test_helm_client_rows_without_exact_match_compare_completions():
    """A scenario whose stats hold no exact-match metric (dyck_language, synthetic_reasoning_natural)
    is compared by its completions, not reported as a NaN difference."""
    from flexgen_helm.tools.compare.helm_clients import agreement, findings

    def row(system, wall, completions):
        return {"host": "A", "system": system, "dtype": "float32", "scenario": "dyck_language", "instances": 3,
                "wall_s": wall, "perplexity": None, "bits_per_byte": None, "completions": completions}
    df = pd.DataFrame([row("hf-float32", 90.0, [["a"], ["b"], ["c"]]),
                       row("ours-float32", 30.0, [["a"], ["x"], ["c"]])])
    text = "\n".join(findings(agreement(df), Path("/nonexistent")))
    assert "completions alike those of hf-float32: `ours-float32` 2 of 3" in text
    assert "nan" not in text


def test_helm_client_runs_keep_their_plan_lines_and_fail_loudly(capsys):
    """helm-run's output is echoed as it comes, and our client's plan lines are kept for the
    row; a failed run is an error, not a row."""
    import subprocess
    import sys

    from flexgen_helm.tools.compare.helm_clients import run_echoing

    script = ("print('2026-11-28 00:57:56,328 INFO   flexgen: batching 3 requests of x {'); "
              "print('2026-11-28 00:57:56,329 INFO     flexgen: running 3 requests in 1 batches of up to 3'); "
              "print('other line')")
    assert run_echoing([sys.executable, "-c", script]) == ["running 3 requests in 1 batches of up to 3"]
    assert "other line" in capsys.readouterr().out
    with pytest.raises(subprocess.CalledProcessError):
        run_echoing([sys.executable, "-c", "import sys; sys.exit(3)"])


@pytest.mark.parametrize("interpreter", ["missing", "without_lm_eval"])
def test_lm_eval_comparison_fails_loudly_without_lm_eval(interpreter, tmp_path):
    """Before anything is exported or timed: an interpreter that is not there, or one that
    cannot import lm_eval, is an error naming it."""
    from flexgen_helm.errors import FlexGenError
    from flexgen_helm.tools.compare import lm_eval_harness

    python = tmp_path / "python"
    if interpreter == "without_lm_eval":
        python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'lm_eval'\" >&2\nexit 1\n")
        python.chmod(0o755)
    with pytest.raises(FlexGenError, match=f"{python}.*(cannot import lm_eval|No such file)"):
        lm_eval_harness.main(["--lm-eval-python", str(python), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_lm_eval_comparison_rejects_an_unwritable_output_folder_before_any_work(tmp_path):
    from flexgen_helm.errors import FlexGenError
    from flexgen_helm.tools.compare import lm_eval_harness

    python = tmp_path / "python"  # an interpreter that imports lm_eval fine
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(FlexGenError, match=f"cannot create the output folder {blocked}/out/json"):
        lm_eval_harness.main(["--lm-eval-python", str(python), "--out", str(blocked / "out")])


def test_helm_client_series_give_medians_of_per_round_speedups():
    from flexgen_helm.tools.compare.helm_clients import series_findings

    def row(system, wall, r, series="S1"):
        return {"host": "A", "system": system, "scenario": "lambada", "instances": 500, "wall_s": wall,
                "series": series, "round": r}
    rows = pd.DataFrame([row("hf-float32", 200.0, 0), row("ours", 40.0, 0),
                         row("ours", 60.0, 1), row("hf-float32", 240.0, 1),  # the order rotated
                         row("hf-float32", 210.0, 2), row("ours", 30.0, 2),
                         {"host": "A", "system": "ours", "scenario": "lambada", "instances": 500, "wall_s": 99.0}])
    (line,) = series_findings(rows)  # the single run (no series) is not one of the rounds
    assert "3 interleaved rounds (series S1)" in line
    assert "`hf-float32` 210.0 s" in line and "`ours` 40.0 s (5.00x, 4.00-7.00)" in line
    assert series_findings(rows.drop(columns=["series", "round"])) == []
