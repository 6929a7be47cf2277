"""The copy engine overlaps transfers with compute: the next layer's weight load runs on a
lane of its own, so it never holds up the transfers the layer computing now waits for."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import engine_device

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.executor.schedule import BlockSchedule
from flexgen_helm.memory import weight_homes
from flexgen_helm.memory.copy_engine import READS_AT_ONCE, CopyEngine
from flexgen_helm.policy import Compression, Policy, Split

CPU32 = dict(dtype="float32", device="cpu", progress=False)


def test_a_weight_load_does_not_hold_up_a_batch_transfer():
    io = CopyEngine(True, torch.device("cpu"))
    release = threading.Event()
    try:
        slow = io.submit(release.wait, 10, lane="weights")
        assert io.submit(lambda: "hidden state").result(timeout=5) == "hidden state"
        assert not slow.done()
    finally:
        release.set()
        io.close()


def test_a_layer_computes_while_the_next_layers_weights_load(tiny_llama, tmp_path, monkeypatch):
    """Weights on disk (the copy engine on): the first block computes while the second
    block's weights are still loading, i.e. its hidden state did not queue behind them."""
    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=2, weights=Split(0, 0, 1)),
                         offload_dir=tmp_path, **CPU32)
    computed = threading.Event()
    real_run, real_load = BlockSchedule._run_layer, engine.runtime.load_layer

    def run_layer(self, layer, *args):
        out = real_run(self, layer, *args)
        if layer.kind == "block":
            computed.set()
        return out

    def load_layer(layer, *args, **kwargs):
        if layer.kind == "block" and layer.index == 1:
            assert computed.wait(10), "block 0 could not compute before block 1's weights were loaded"
        return real_load(layer, *args, **kwargs)

    monkeypatch.setattr(BlockSchedule, "_run_layer", run_layer)
    monkeypatch.setattr(engine.runtime, "load_layer", load_layer)
    run = engine.generate([[5, 17, 3], [12, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert all(len(r.completions[0].token_ids) == 2 for r in run.results)


@pytest.mark.parametrize("compress_weight", [None, Compression(4, 16)], ids=["plain", "4-bit"])
def test_a_layers_weight_reads_from_disk_are_in_flight_together(tiny_llama, tmp_path, monkeypatch, compress_weight):
    """Weights on disk: the tensors of a layer are read at once (one at a time, each of a
    4-bit layer's many small reads waited for the one before); the tokens do not change."""
    policy = Policy(gpu_batch_size=2, weights=Split(0, 0, 1), compress_weight=compress_weight)
    engine = Engine.load(str(tiny_llama), policy, **CPU32)
    prompts, params = [[5, 17, 3], [12, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True)
    want = [r.completions[0].token_ids for r in engine.generate(prompts, params).results]
    # per block, a barrier that breaks unless all of its tensors' reads wait at once
    barriers = {}
    for layer in engine.runtime.layers:
        if layer.kind == "block":
            names = {t.store_name for t in layer.tensors}
            together = threading.Barrier(len(names), timeout=10)
            barriers.update({name: together for name in names})
    real_read = weight_homes.read_parts

    def read_parts(home, store):
        if home.spec.store_name in barriers:
            barriers[home.spec.store_name].wait()
        return real_read(home, store)

    monkeypatch.setattr(weight_homes, "read_parts", read_parts)
    got = [r.completions[0].token_ids for r in engine.generate(prompts, params).results]
    assert got == want


def test_a_fan_out_has_its_reads_in_flight_together():
    io = CopyEngine(True, torch.device("cpu"))
    together = threading.Barrier(READS_AT_ONCE, timeout=10)  # breaks unless all wait at once

    def read(i):
        together.wait()
        return i

    try:
        assert io.fan_out(read, list(range(READS_AT_ONCE))) == list(range(READS_AT_ONCE))
    finally:
        io.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["lanes", "inline"])
def test_transfers_and_generation_run_without_autograd(tiny_llama, overlap):
    """Inference mode is per thread: the lanes' workers, the fan-out's and the driver's own
    thread each skip autograd's per-op bookkeeping (~10% of a step of many small ops)."""
    io = CopyEngine(overlap, torch.device("cpu"))
    try:
        assert io.fan_out(lambda _: torch.is_inference_mode_enabled(), [0, 1]) == [True, True]
        with torch.inference_mode(False):  # inline, a transfer runs on the caller's thread
            assert io.submit(torch.is_inference_mode_enabled).result() is overlap
    finally:
        io.close()
    engine = Engine.load(str(tiny_llama), policy=Policy(), **CPU32)
    seen = []
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2),
                    on_step=lambda done, total: seen.append(torch.is_inference_mode_enabled()))
    assert seen and all(seen)


def test_copies_on_streams_need_overlap_on_a_gpu():
    with pytest.raises(ValueError, match="overlap on a GPU"):
        CopyEngine(True, torch.device("cpu"), on_streams=True)


def test_an_unknown_way_of_copying_on_a_gpu_is_refused_by_name(tiny_llama, monkeypatch):
    monkeypatch.setenv("FLEXGEN_HELM_CUDA_COPIES", "fibers")
    engine = Engine.load(str(tiny_llama), policy=Policy(), **CPU32)
    with pytest.raises(ValueError, match="FLEXGEN_HELM_CUDA_COPIES='fibers': expected one of streams, threads"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))


@pytest.mark.skipif(engine_device() != "cuda", reason="copies on streams are a GPU's (pytest --device cuda)")
@pytest.mark.parametrize("policy", [
    Policy(gpu_batch_size=2, num_gpu_batches=3, weights=Split(0.3, 0.7, 0), cache=Split(0.4, 0.6, 0),
           activations=Split(0.5, 0.5, 0)),
    Policy(gpu_batch_size=2, num_gpu_batches=3, weights=Split(0, 1, 0), cache=Split(0.2, 0.8, 0),
           attn_sparsity=0.5),
    Policy(gpu_batch_size=3, num_gpu_batches=2, cache=Split(0.5, 0.5, 0), compress_cache=Compression(4, 4)),
], ids=["split", "sparse", "compressed-cache"])
def test_copies_on_streams_give_the_threads_tokens_and_logprobs(tiny_llama, tmp_path, monkeypatch, policy):
    """FLEXGEN_HELM_CUDA_COPIES=streams (memory/copy_engine.py, the default): the same greedy tokens and
    float32 log-probs as the worker threads' copies, where a step's loads and stores of
    weights, cache and hidden states in RAM interleave with its compute."""
    prompts = [[5 + (i * 7 + j) % 200 for j in range(6 + i)] for i in range(policy.block_size)]
    runs = {}
    for way in ("threads", "streams"):
        monkeypatch.setenv("FLEXGEN_HELM_CUDA_COPIES", way)
        engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cuda", offload_dir=tmp_path,
                             progress=False)
        runs[way] = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True)).results
    for a, b in zip(runs["threads"], runs["streams"], strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs


@pytest.mark.parametrize("way", ["streams", "threads"])
@pytest.mark.parametrize("kwargs,threaded_on_streams", [
    (dict(weights=Split(0, 1, 0)), False),
    (dict(weights=Split(0, 0.5, 0.5)), True),
    (dict(weights=Split(0, 1, 0), cache=Split(0.5, 0.5, 0), cpu_cache_compute=True), True),
    (dict(weights=Split(0, 1, 0), overlap=False), False),
], ids=["ram", "disk", "delegated", "no-overlap"])
def test_the_cost_model_charges_the_copy_threads_hand_offs_where_the_schedule_uses_them(monkeypatch, way, kwargs,
                                                                                         threaded_on_streams):
    """A GPU's layer costs TRANSFERS_PER_LAYER_BATCH hand-offs to the copy threads where its
    transfers run on them (executor/transfer_ways.py): with anything on disk, where the host
    reads the cache in RAM (CPU delegation), or with FLEXGEN_HELM_CUDA_COPIES=threads; not on
    streams (the default) nor with overlap off."""
    from dataclasses import replace

    from test_policy_search import OPT13, gpu_profile

    from flexgen_helm.planner.cost_model import TRANSFERS_PER_LAYER_BATCH, CostModel, Workload

    monkeypatch.setenv("FLEXGEN_HELM_CUDA_COPIES", way)
    hw = gpu_profile()
    fixed = {"per_layer_batch": 1e-4, "per_step": 1e-3}
    hw.devices["cuda"] = replace(hw.compute, copy_handoff_s=1e-4, fixed_costs={"opt": {"decode": fixed}})
    model = CostModel(OPT13, hw, Workload(512, 32))
    block = next(layer for layer, _ in model.groups if layer.kind == "block")
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, **kwargs)
    threaded = policy.overlap and (way == "threads" or threaded_on_streams)
    assert model._fixed_per_layer_batch(block, policy, "decode") == pytest.approx(
        1e-4 + (TRANSFERS_PER_LAYER_BATCH * 1e-4 if threaded else 0.0))


@pytest.mark.parametrize("setting", [None, "threads"])
def test_the_overhead_probe_runs_its_copies_on_streams_whatever_the_setting(monkeypatch, setting):
    """The profile's fixed costs hold no hand-offs to the copy threads (planner/overhead_profile.py),
    which the cost model adds where the threads run: the probe's runs see the streams setting,
    and the user's setting is as it was afterwards."""
    from flexgen_helm.executor import generation
    from flexgen_helm.memory.copy_engine import COPIES_SETTING, cuda_copies
    from flexgen_helm.memory.devices import pick_devices
    from flexgen_helm.planner import overhead_profile

    if setting is None:
        monkeypatch.delenv(COPIES_SETTING, raising=False)
    else:
        monkeypatch.setenv(COPIES_SETTING, setting)
    seen = []
    generate = generation.BlockDriver.generate

    def watched(self, seqs):
        seen.append(cuda_copies())
        return generate(self, seqs)

    monkeypatch.setattr(generation.BlockDriver, "generate", watched)
    overhead_profile.measure_fixed_costs(pick_devices("cpu", "float32"), repeats=1)
    assert seen and set(seen) == {"streams"}
    assert os.environ.get(COPIES_SETTING) == setting
