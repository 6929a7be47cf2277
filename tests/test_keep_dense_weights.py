"""A block that keeps its compressed weights dense (Policy.keep_dense_weights): it loads each
layer once, computes with the dense copies a dequantization per use would make (bitwise), the
memory it accounts is the copies the cost model counts, and the search turns it on only where
the copies fit and pay."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from test_random_moe_gguf import tiny_olmoe_config

from flexgen_helm.compression import int4, int8
from flexgen_helm.engine import Engine
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_info
from flexgen_helm.models.opt import config_for_size
from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile
from flexgen_helm.planner.search import Budgets, SearchOptions, default_budgets, search
from flexgen_helm.policy import Compression, Policy, Split
from flexgen_helm.policy.policy import PER_CHANNEL
from flexgen_helm.tools.compare.random_moe_gguf import write

GIB = 2**30
PROMPTS = [[5, 17, 42, 7, 99], [3, 8, 1], [9, 9, 4, 2]]
GRIDS = {"8-bit per channel": Compression(8, PER_CHANNEL), "4-bit g16": Compression(4, 16)}
BF16 = dict(dtype="bfloat16", device="cpu", progress=False)


def _generate(engine: Engine) -> list:
    run = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    return [(c.token_ids, c.logprobs) for r in run.results for c in r.completions]


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_kept_copies_compute_what_a_dequantization_per_use_computes(tiny_llama, tmp_path, monkeypatch, grid):
    """bfloat16, so that the kernels would round differently: with every kernel off, each use
    dequantizes (the reference); keeping the copies gives the same bits, and loads each layer
    once for the block instead of at every step."""
    policy = Policy(4, 1, compress_weight=grid)
    monkeypatch.setitem(int4.MAX_KERNEL_ROWS, "cpu", 0)
    monkeypatch.setitem(int8.MAX_KERNEL_ROWS, "cpu", 0)
    per_use = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path / "a", **BF16)
    want = _generate(per_use)
    made = []
    real_track = int4.DENSE_COPIES.track
    monkeypatch.setattr(int4.DENSE_COPIES, "track", lambda w, n: made.append(n) or real_track(w, n))
    kept = Engine.load(str(tiny_llama), Policy(4, 1, compress_weight=grid, keep_dense_weights=True),
                       offload_dir=tmp_path / "b", **BF16)
    # the weights are all in the compute tier: the copies serve every block, so the load makes
    # them (one per compressed weight), and no block loads or dequantizes anything again
    copies = kept.runtime.kept.nbytes
    assert copies > 0 and sum(made) == copies
    assert kept.runtime.usage.current["gpu"] == per_use.runtime.usage.current["gpu"] + copies
    loads = []
    real_load = kept.runtime.load_layer
    monkeypatch.setattr(kept.runtime, "load_layer", lambda layer, *a, **k: loads.append(layer) or real_load(
        layer, *a, **k))
    for _ in range(2):
        assert _generate(kept) == want
    assert not loads and sum(made) == copies
    kept.set_policy(policy)  # a block that keeps none lets them go
    assert _generate(kept) == want
    assert kept.runtime.kept is None
    assert kept.runtime.usage.current["gpu"] == per_use.runtime.usage.current["gpu"]
    kept.set_policy(Policy(4, 1, compress_weight=grid, keep_dense_weights=True))  # the next one makes them again
    made.clear()
    assert _generate(kept) == want
    assert kept.runtime.kept.nbytes == copies and sum(made) == copies
    assert kept.runtime.usage.current["gpu"] == per_use.runtime.usage.current["gpu"] + copies
    kept.close()
    assert kept.runtime.usage.current["gpu"] == per_use.runtime.usage.current["gpu"]


def test_the_load_makes_the_copy_of_a_multiplied_weight_beside_the_tables(tmp_path, monkeypatch):
    """OPT's project_in lives with the embedding tables but is multiplied: the load makes its
    copy too, and the first block makes none."""
    from conftest import save_tiny

    path = save_tiny("opt", tmp_path / "opt-project-in", word_embed_proj_dim=16)
    made = []
    real_track = int4.DENSE_COPIES.track
    monkeypatch.setattr(int4.DENSE_COPIES, "track", lambda w, n: made.append(n) or real_track(w, n))
    engine = Engine.load(str(path), Policy(4, 1, compress_weight=Compression(8, PER_CHANNEL), keep_dense_weights=True),
                         offload_dir=tmp_path, **BF16)
    copies = engine.runtime.kept.nbytes
    assert sum(made) == copies and 32 * 16 * 2 in made  # project_in: (hidden 32, 16) in bf16
    _generate(engine)
    assert sum(made) == copies


def test_copies_of_weights_off_the_compute_tier_go_with_their_block(tiny_llama, tmp_path):
    """A layer loaded from the cpu tier is a load of its own (on a GPU, a copy in its memory),
    which the block held only while it ran: its dense copies go with it."""
    policy = Policy(4, 1, weights=Split(0.5, 0.5, 0), compress_weight=Compression(4, 16), keep_dense_weights=True)
    engine = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path, **BF16)
    before = engine.runtime.usage.current["gpu"]
    _generate(engine)
    assert engine.runtime.kept is None and engine.runtime.usage.current["gpu"] == before


@pytest.mark.parametrize("grid", [Compression(8, PER_CHANNEL), Compression(4, 4, group_dim=0)],
                         ids=["8-bit per channel", "4-bit groups along dim 0"])
def test_the_cost_model_counts_the_copies_the_engine_keeps(tiny_llama, tmp_path, monkeypatch, grid):
    """Every compressed weight multiplied, and a table whose groups run down its columns (it
    dequantizes whole to look rows up), as the engine's account of the block says."""
    engine = Engine.load(str(tiny_llama), Policy(4, 1, compress_weight=grid, keep_dense_weights=True),
                         offload_dir=tmp_path, **BF16)
    _generate(engine)
    kept = engine.runtime.kept.nbytes  # kept for the next block (the weights are in the compute tier)
    assert kept > 0
    assert engine.runtime.usage.peak["gpu"] >= kept
    cpu = DeviceSpeeds({"bfloat16": {1: 1e9, 512: 1e11}}, int8_matmul_flops={1: 1e9, 512: 1e10},
                       int8_dequant_elems_per_s=1e9)
    model = CostModel(engine.config, HardwareProfile(devices={"cpu": cpu}, machine=machine_info()), Workload(5, 4),
                      torch.bfloat16)
    assert model.kept_dense_bytes(Policy(4, 1, compress_weight=grid, keep_dense_weights=True)) == kept


OPT13 = config_for_size("1.3b")
W4 = Compression(4, 64)
DENSE = {1: 2e9, 8: 15e9, 32: 60e9, 128: 200e9, 512: 300e9}
SLOW_KERNEL = {r: f / 4 for r, f in DENSE.items()}  # slower than a dense matmul at every row count


def _profile() -> HardwareProfile:
    cpu = DeviceSpeeds({"bfloat16": DENSE}, int4_matmul_flops=SLOW_KERNEL, int4_dequant_elems_per_s=2e9)
    return HardwareProfile(devices={"cpu": cpu}, memcpy_bytes_per_s=5e9, disk_read_bytes_per_s=1e9,
                           disk_write_bytes_per_s=5e8, cpu_mem_bytes=24 * GIB, cpu_available_bytes=20 * GIB,
                           disk_free_bytes=100 * GIB)


def test_the_search_keeps_dense_copies_only_where_they_fit_and_pay():
    """A kernel slower than dequantize-then-matmul at every row count: each decode step
    dequantizes every layer again, unless the block keeps the copies its prefill made. With
    room for them the search keeps them; with a compute pool that holds the 4-bit weights but
    not their dense copies, it cannot."""
    prof = _profile()
    options = SearchOptions(max_block_size=8, compress_weight=W4)
    roomy = search(OPT13, prof, 64, 64, default_budgets(prof), options)
    assert roomy.policy.keep_dense_weights
    model = CostModel(OPT13, prof, Workload(64, 64))
    without = model.estimate(Policy(roomy.policy.gpu_batch_size, roomy.policy.num_gpu_batches, compress_weight=W4))
    assert roomy.estimate.decode_step_s < without.decode_step_s
    assert roomy.estimate.peak_bytes["decode"]["gpu"] > without.peak_bytes["decode"]["gpu"] + GIB  # 2.6 GB of copies
    tight = Budgets(gpu=int(1.5 * GIB), cpu=8 * GIB, disk=100 * GIB)
    assert not search(OPT13, prof, 64, 64, tight, options).policy.keep_dense_weights
    with pytest.raises(PolicyError, match=r"keep_dense_weights: no block fits the budgets \(gpu tier 1.50 GiB"):
        search(OPT13, prof, 64, 64, tight, SearchOptions(max_block_size=8, compress_weight=W4,
                                                         keep_dense_weights=True))


def test_what_keeping_dense_copies_cannot_do_is_refused(tmp_path):
    with pytest.raises(PolicyError, match="compress_weight is not set"):
        Policy(keep_dense_weights=True)
    with pytest.raises(PolicyError, match="on disk"):
        Policy(weights=Split(0.5, 0.2, 0.3), compress_weight=W4, keep_dense_weights=True)
    path = tmp_path / "moe.gguf"
    write(tiny_olmoe_config(), path)
    with pytest.raises(PolicyError, match="mixture of experts"):
        Engine.load(str(path), Policy(compress_weight=W4, keep_dense_weights=True), offload_dir=tmp_path, **BF16)
    engine = Engine.load(str(path), Policy(), offload_dir=tmp_path, **BF16)
    with pytest.raises(PolicyError, match="mixture of experts"):  # nor for a later block
        engine.set_policy(Policy(compress_weight=W4, keep_dense_weights=True))
    with pytest.raises(PolicyError, match="mixture of experts"):  # nor planned
        search(engine.config, _profile(), 8, 4, default_budgets(_profile()),
               SearchOptions(compress_weight=W4, keep_dense_weights=True))


KEEP_POLICIES = {
    "merged-batches": dict(gpu_batch_size=1, num_gpu_batches=3),
    "weights-cpu-delegated-no-overlap": dict(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0.4, 0.6, 0),
                                             cache=Split(0, 1, 0), cpu_cache_compute=True, overlap=False),
    "cache-disk": dict(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0.5, 0, 0.5)),
}


@pytest.mark.parametrize("name", list(KEEP_POLICIES))
def test_float32_results_are_the_same_kept_or_not(tiny_llama, tmp_path, name):
    """float32 dequantizes at every use without keeping (no kernel computes float32): keeping
    the copies changes no bit, under merged decode steps, CPU delegation, a cache on disk."""
    grid = Compression(4, 16)
    runs = []
    for keep in (False, True):
        policy = Policy(**KEEP_POLICIES[name], compress_weight=grid, keep_dense_weights=keep)
        engine = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path / str(keep), dtype="float32", device="cpu",
                             progress=False)
        runs.append(_generate(engine))
    assert runs[0] == runs[1]


W8 = Compression(8, PER_CHANNEL)


@pytest.mark.parametrize("int8_faster", [True, False], ids=["int8-kernel-faster", "int8-kernel-slower"])
def test_8bit_decode_is_costed_on_the_int8_kernel_where_the_engine_takes_it(int8_faster):
    """Per output channel, 8-bit weights multiply decode rows on the int8 kernel up to its
    profiled crossover (compression/int8.py): the cost model charges that kernel's speed there,
    so the search keeps dense copies only where they beat it."""
    kernel = {r: f * (2 if int8_faster else 0.25) for r, f in DENSE.items()}
    cpu = DeviceSpeeds({"bfloat16": DENSE}, int8_matmul_flops=kernel, int8_dequant_elems_per_s=2e9)
    prof = HardwareProfile(devices={"cpu": cpu}, memcpy_bytes_per_s=5e9, disk_read_bytes_per_s=1e9,
                           disk_write_bytes_per_s=5e8, cpu_mem_bytes=24 * GIB, cpu_available_bytes=20 * GIB,
                           disk_free_bytes=100 * GIB)
    model = CostModel(OPT13, prof, Workload(64, 64))
    assert model.int8_kernel_takes(8) == int8_faster
    on_kernel = model.estimate(Policy(8, 1, compress_weight=W8))
    kept = model.estimate(Policy(8, 1, compress_weight=W8, keep_dense_weights=True))
    assert (on_kernel.decode_step_s < kept.decode_step_s) == int8_faster
    chosen = search(OPT13, prof, 64, 64, default_budgets(prof), SearchOptions(max_block_size=8, compress_weight=W8))
    assert chosen.policy.keep_dense_weights != int8_faster


LOAD_HOLES = """
from flexgen_helm.engine import Engine
from flexgen_helm.memory.host_allocator import heap_free_bytes
from flexgen_helm.policy import Compression, Policy
policy = Policy(compress_weight=Compression(4, 32, method="gguf"), keep_dense_weights=True)
engine = Engine.load("smollm2-135m", policy, dtype="bfloat16", device="cpu", progress=False)
print(engine.runtime.kept.nbytes >> 20, heap_free_bytes() >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap")
def test_dense_copies_made_at_load_leave_no_holes_in_the_heap():
    """The bundled model's 4-bit deployment makes its ~260 MiB of dense copies at load through
    temporaries as large: those go to mappings of their own, not holes between the copies
    that every later prefill would fault in again (156 MB of holes before, 1.1-1.2x BF16's
    prefill: runs/compression_8bit/load_holes/)."""
    done = subprocess.run([sys.executable, "-c", LOAD_HOLES], capture_output=True, text=True, check=True)
    kept_mib, holes_mib = map(int, done.stdout.split()[-2:])
    assert kept_mib > 200 and holes_mib < 32
