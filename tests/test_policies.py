"""The policy never changes the answer: every placement, block shape, overlap setting and
CPU delegation gives the same tokens, and (in fp32) the same log-probs to rounding."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import compute_dtypes, engine_device

from flexgen_helm.engine import Engine
from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.generation import plan_blocks
from flexgen_helm.executor.kv_cache import KVCacheSlot
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.executor.schedule import BlockSchedule, GpuBatch
from flexgen_helm.executor.shared_prefix import SharedPrefix
from flexgen_helm.memory.placement import slot_tier_counts, split_in_turn
from flexgen_helm.planner.budget import planned_components
from flexgen_helm.policy import Compression, Policy, Split
from flexgen_helm.policy.policy import TIERS

# mixed lengths, three of them close enough to share a left-padded GPU batch (plan_blocks);
# 10 prompts is not a multiple of any block below but one
PROMPTS = [[5, 17, 3, 44, 9, 21, 8, 2, 60], [12, 7], [30, 31, 32, 33], [1, 2, 3], [40] * 11, [8, 9, 10, 11, 12], [70],
           list(range(3, 29)), list(range(50, 74)), list(range(6, 31))]
N_NEW = 5

POLICIES = {
    "all-gpu-1x1": Policy(),
    "weights-split-2x3": Policy(gpu_batch_size=2, num_gpu_batches=3, weights=Split(0.3, 0.4, 0.3)),
    "weights-disk-4x2": Policy(gpu_batch_size=4, num_gpu_batches=2, weights=Split(0, 0, 1)),
    "cache-cpu-delegated": Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 1, 0), cpu_cache_compute=True),
    "cache-disk-no-overlap": Policy(gpu_batch_size=4, num_gpu_batches=2, cache=Split(0, 0, 1), overlap=False),
    "cache-split-delegated": Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0.25, 0.5, 0.25),
                                    cpu_cache_compute=True),
    "activations-cpu-disk": Policy(gpu_batch_size=2, num_gpu_batches=2, activations=Split(0.2, 0.5, 0.3)),
    "everything-split-no-overlap": Policy(gpu_batch_size=4, num_gpu_batches=2, weights=Split(0.2, 0.3, 0.5),
                                          cache=Split(0.3, 0.3, 0.4), activations=Split(0.5, 0.25, 0.25),
                                          overlap=False, cpu_cache_compute=True),
}


@pytest.fixture(scope="module", params=["tiny_opt", "tiny_llama"])
def model_path(request):
    return request.getfixturevalue(request.param)


# fp16 rounds each log-prob to ~1e-3 of its size, and CPU-delegated attention runs in
# float32: tokens stay identical, log-probs move in the third decimal
LOGPROB_TOLERANCE = {"float32": 1e-4, "float16": 2e-2}


@pytest.fixture(scope="module")
def reference(model_path):
    """Each compute dtype's reference run (everything on the compute device, no overlap)."""
    runs = {}

    def run(dtype: str):
        if dtype not in runs:
            engine = Engine.load(str(model_path), Policy(overlap=False), dtype=dtype, device=engine_device(),
                                 progress=False)
            runs[dtype] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)).results
        return runs[dtype]
    return run


@pytest.mark.parametrize("dtype", compute_dtypes())
@pytest.mark.parametrize("name", list(POLICIES))
def test_same_tokens_and_logprobs_under_every_policy(model_path, reference, name, dtype, tmp_path):
    engine = Engine.load(str(model_path), POLICIES[name], dtype=dtype, device=engine_device(), offload_dir=tmp_path,
                         progress=False)
    got = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)).results
    for r, ref in zip(got, reference(dtype)):
        assert r.completions[0].token_ids == ref.completions[0].token_ids
        assert r.completions[0].logprobs == pytest.approx(ref.completions[0].logprobs, abs=LOGPROB_TOLERANCE[dtype])
    assert list(tmp_path.glob("run-*")) == []  # runtime files are cleaned up


def test_sampling_with_seed_is_policy_independent(tiny_llama, tmp_path):
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True,
                            num_completions=2)
    outs = []
    for policy in (Policy(), POLICIES["everything-split-no-overlap"]):
        engine = Engine.load(str(tiny_llama), policy, dtype="float32", device=engine_device(), offload_dir=tmp_path,
                             progress=False)
        outs.append([[c.token_ids for c in r.completions] for r in engine.generate(PROMPTS, params).results])
    assert outs[0] == outs[1]


def test_a_tied_weight_is_loaded_once_for_the_head_and_the_next_embedding(tiny_opt, tmp_path, monkeypatch):
    """The head and the next step's embedding share OPT's token embedding: split over tiers it
    is assembled once for both (the head's copy serves the embedding that follows), so a run
    of n tokens loads it 1 + n times (the first embedding, then each step's head), not 2n."""
    from flexgen_helm.memory import weight_homes

    loads = []
    real = weight_homes.load_home
    monkeypatch.setattr(weight_homes, "load_home",
                        lambda home, *a: loads.append(home.spec.store_name) or real(home, *a))
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0.2, 0.5, 0.3))
    engine = Engine.load(str(tiny_opt), policy, dtype="float32", device=engine_device(), offload_dir=tmp_path,
                         progress=False)
    assert len(engine.runtime.placement["embed.tokens.weight"]) > 1  # split: every load is a copy
    engine.generate(PROMPTS[:4], SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    assert loads.count("embed.tokens.weight") == 1 + N_NEW
    assert loads.count("layers.0.fc1.weight") == N_NEW


def test_placement_is_honest(tiny_opt, tmp_path):
    policy = Policy(weights=Split(0.2, 0.5, 0.3))
    engine = Engine.load(str(tiny_opt), policy, dtype="float32", device=engine_device(), offload_dir=tmp_path,
                         progress=False)
    frac = engine.memory_report()["placement"]["weight_fractions"]
    assert frac["gpu"] == pytest.approx(0.2, abs=0.02)
    assert frac["cpu"] == pytest.approx(0.5, abs=0.02)
    assert frac["disk"] == pytest.approx(0.3, abs=0.02)


def test_scoring_from_a_position_returns_those_logprobs_and_nothing_before(tiny_llama, tmp_path):
    """first_scored (LAMBADA's last word): the same log-probs and top entries as a full
    score from that token on, nan and no entries before it, whatever the padding."""
    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=4, num_gpu_batches=2), dtype="float32",
                         device=engine_device(), offload_dir=tmp_path, progress=False)
    full = engine.score(PROMPTS, top_logprobs=2).results
    firsts = [max(1, len(p) - 2) for p in PROMPTS]
    part = engine.score(PROMPTS, top_logprobs=2, first_scored=firsts).results
    for f, whole, some in zip(firsts, full, part):
        assert all(math.isnan(x) for x in some.logprobs[:f])
        assert some.logprobs[f:] == pytest.approx(whole.logprobs[f:], abs=1e-5)
        assert all(top == {} for top in some.top_logprobs[:f])
        assert [list(t) for t in some.top_logprobs[f:]] == [list(t) for t in whole.top_logprobs[f:]]
        for got, want in zip(some.top_logprobs[f:], whole.top_logprobs[f:]):
            assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    one_token = engine.score([[5], [7]], top_logprobs=2).results  # nothing to score: no head at all
    assert [(r.logprobs, r.top_logprobs) for r in one_token] == [([pytest.approx(math.nan, nan_ok=True)], [{}])] * 2
    with pytest.raises(FlexGenError, match="first_scored"):
        engine.score(PROMPTS[:2], first_scored=[1, 3])  # the second prompt has 2 tokens


@pytest.mark.parametrize("cache", [None, Compression(4, 4, cache_grouping="kivi")], ids=["dense", "kivi"])
def test_a_blocks_gpu_batches_each_pad_to_their_own_longest_prompt(tiny_llama, tmp_path, cache):
    """One block of GPU batches of different prompt lengths: each is padded to its own
    longest prompt, not the block's (the padded tokens counted say so), and every prompt's
    scores, with the cache as a decode step reads it, and its generated tokens are those it
    gets alone (float32)."""
    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=2, num_gpu_batches=4, compress_cache=cache),
                         dtype="float32", device=engine_device(), offload_dir=tmp_path,
                         progress=False)
    together = engine.score(PROMPTS, top_logprobs=2, as_decode=True)
    assert [[len(PROMPTS[i]) for i in batch] for block in plan_blocks(list(map(len, PROMPTS)), engine.policy)
            for batch in block] == [[26, 25], [24], [11], [9], [5], [4], [3], [2], [1]]
    # one padded position (25 -> 26); padded to the block's longest, the first block alone would pad 91
    assert (together.stats.prompt_tokens, together.stats.padded_prompt_tokens) == (110, 111)
    for prompt, got in zip(PROMPTS, together.results):
        alone = engine.score([prompt], top_logprobs=2, as_decode=True).results[0]
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5, nan_ok=True)
        assert [list(t) for t in got.top_logprobs] == [list(t) for t in alone.top_logprobs]
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    generated = engine.generate(PROMPTS, params).results  # decode steps share the block's positions
    for prompt, got in zip(PROMPTS, generated):
        alone = engine.generate([prompt], params).results[0].completions[0]
        assert got.completions[0].token_ids == alone.token_ids
        assert got.completions[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_the_columns_a_shorter_gpu_batch_skips_never_reach_attention_as_garbage(tiny_llama, tmp_path,
                                                                                 monkeypatch):
    """The block's columns before a shorter GPU batch's own are written (zeros, masked), never
    left as the cache's uninitialised memory: a NaN there reaches attention as 0 x NaN."""
    real = KVCacheSlot._empty

    def nan_filled(self, *args):
        stored = real(self, *args)
        if isinstance(stored, torch.Tensor) and stored.device.type != "meta":
            stored.fill_(math.nan)
        return stored

    monkeypatch.setattr(KVCacheSlot, "_empty", nan_filled)
    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=2, num_gpu_batches=4), dtype="float32",
                         device=engine_device(), offload_dir=tmp_path, progress=False)
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    for prompt, got in zip(PROMPTS, engine.generate(PROMPTS, params).results):
        alone = engine.generate([prompt], params).results[0].completions[0]
        assert got.completions[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


@pytest.mark.parametrize("policy", [
    Policy(gpu_batch_size=3, num_gpu_batches=3, cache=Split(0.3, 0.45, 0.25), activations=Split(0.35, 0.3, 0.35)),
    Policy(gpu_batch_size=5, num_gpu_batches=2, cache=Split(1 / 3, 1 / 3, 1 / 3), activations=Split(0.1, 0.1, 0.8)),
    Policy(gpu_batch_size=1, num_gpu_batches=7, cache=Split(0.05, 0.9, 0.05), activations=Split(0.4, 0.2, 0.4),
           compress_cache=Compression(4, 4)),
], ids=["3x3", "5x2-thirds", "1x7-compressed"])
def test_budget_plans_the_cache_and_activations_the_schedule_allocates(tiny_llama, tmp_path, policy):
    """The plan that checks the budgets and the run split units over the tiers the same way,
    so for odd splits the planned bytes per tier are the bytes allocated, to the byte."""
    engine = Engine.load(str(tiny_llama), Policy(), dtype="float32", device=engine_device(), offload_dir=tmp_path,
                         progress=False)
    rt, max_len = engine.runtime, 20
    batches = [GpuBatch(torch.zeros(policy.gpu_batch_size, 6, dtype=torch.long),
                        torch.ones(policy.gpu_batch_size, 6, dtype=torch.bool)) for _ in range(policy.num_gpu_batches)]
    before = dict(rt.usage.current)
    sched = BlockSchedule(rt, policy, batches, max_len, tmp_path)
    try:
        allocated = {t: rt.usage.current.get(t, 0) - before.get(t, 0) for t in TIERS}  # the KV cache slots
        act_rows = {t: sum(a.rows[t] for a in sched.acts) for t in TIERS}
    finally:
        sched.close()
    planned = planned_components(rt.config, policy, max_len, torch.float32)
    assert planned["cache"] == allocated and all(allocated.values())
    row_bytes = max_len * rt.config.hidden_size * 4
    assert planned["activations"] == {t: act_rows[t] * row_bytes for t in TIERS} and all(act_rows.values())


@pytest.mark.parametrize("policy", [
    Policy(gpu_batch_size=3, num_gpu_batches=3, cache=Split(0.3, 0.45, 0.25)),
    Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0.25, 0.5, 0.25), cpu_cache_compute=True,
           compress_cache=Compression(4, 4, cache_grouping="per-token")),
    Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0.3, 0.3, 0.4),
           compress_cache=Compression(4, 4, cache_grouping="kivi")),
    Policy(gpu_batch_size=1, num_gpu_batches=5, cache=Split(0.2, 0.2, 0.6), compress_cache=Compression(8, 4),
           attn_sparsity=0.5),
    Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0.5, 0.5, 0), attn_sparsity=0.5),
], ids=["plain", "per-token-delegated", "kivi", "kivi-8bit-sparse", "sparse"])
def test_budget_plans_a_shared_prefix_block_as_the_schedule_allocates(tiny_llama, tmp_path, policy):
    """A block whose prompts share a prefix holds it once, as its cache stores it (compressed
    too; under KIVI its complete groups): the planned cache bytes per tier, the one copy
    included, are what the slots and the prefill's copy take, to the byte."""
    engine = Engine.load(str(tiny_llama), Policy(), dtype="float32", device=engine_device(), offload_dir=tmp_path,
                         progress=False)
    rt, max_len, prefix = engine.runtime, 20, list(range(3, 12))  # KIVI's groups of 4: 8 held, 1 the rows'
    batches = [GpuBatch(torch.tensor([prefix + [20 + i, 30 + k, 40]] * policy.gpu_batch_size),
                        torch.ones(policy.gpu_batch_size, len(prefix) + 3, dtype=torch.bool))
               for k, i in enumerate(range(policy.num_gpu_batches))]
    before = dict(rt.usage.current)
    shared = SharedPrefix(torch.tensor([prefix], device=rt.devices.compute))  # as the engine makes it
    sched = BlockSchedule(rt, policy, batches, max_len, tmp_path, shared_prefix=shared)
    try:
        sched.prefill(lambda k, w, h: None)
        for a in sched.acts:  # the prefill's hidden states: not the cache's
            a.close()
        allocated = {t: rt.usage.current.get(t, 0) - before.get(t, 0) for t in TIERS}  # the slots, the copy
    finally:
        sched.close()
    planned = planned_components(rt.config, policy, max_len, torch.float32, shared_prefix=len(prefix),
                                 gpu_compute=rt.devices.compute.type == "cuda")
    assert planned["cache"] == allocated
    assert planned["cache"] != planned_components(rt.config, policy, max_len, torch.float32)["cache"]


def test_delegation_on_a_gpu_plans_a_shared_prefix_copy_where_each_share_is_attended(tiny_llama):
    """Under CPU delegation a GPU machine attends to the cache's cpu and disk shares in RAM,
    so the schedule keeps the block's prefix copy there too (on a CPU-only machine the one
    copy serves all); the plan counts each copy on its tier. The CUDA run of the schedule
    test above caught the copy in RAM missing: runs/gpu/h200-2026-11-28/README.md."""
    cfg = Engine.load(str(tiny_llama), Policy(), dtype="float32", device="cpu", progress=False).runtime.config

    def added_on_a_gpu(cache: Split) -> dict[str, int]:
        policy = Policy(gpu_batch_size=2, num_gpu_batches=2, cache=cache, cpu_cache_compute=True)
        on = {gpu: planned_components(cfg, policy, 20, torch.float32, shared_prefix=9, gpu_compute=gpu)["cache"]
              for gpu in (False, True)}
        return {t: on[True][t] - on[False][t] for t in TIERS}

    copy = added_on_a_gpu(Split(0.25, 0.5, 0.25))["cpu"]  # a second copy, in RAM
    assert copy > 0
    assert added_on_a_gpu(Split(0.25, 0.5, 0.25)) == {"gpu": 0, "cpu": copy, "disk": 0}
    assert added_on_a_gpu(Split(1, 0, 0)) == {"gpu": 0, "cpu": 0, "disk": 0}  # nothing delegated
    assert added_on_a_gpu(Split(0, 0.5, 0.5)) == {"gpu": -copy, "cpu": copy, "disk": 0}  # all of it delegated


def test_groups_split_in_turn_keep_the_totals_near_the_fractions():
    rng = random.Random(0)
    for _ in range(200):
        gpu, cpu = sorted(rng.random() for _ in range(2))
        split = Split(gpu, cpu - gpu, 1 - cpu)
        sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 30))]
        placed = {t: 0 for t in TIERS}
        for n, counts in zip(sizes, split_in_turn(split, sizes), strict=True):
            assert sum(counts.values()) == n and min(counts.values()) >= 0
            placed = {t: placed[t] + counts[t] for t in TIERS}
            seen = sum(placed.values())
            assert abs(placed["gpu"] - seen * split.gpu) <= 0.5 + 1e-9
            assert all(abs(placed[t] - seen * getattr(split, t)) < 2.5 for t in ("cpu", "disk"))
    seven = list(split_in_turn(Split(0.4, 0.2, 0.4), [1] * 7))
    assert {t: sum(c[t] for c in seven) for t in TIERS} == {"gpu": 3, "cpu": 2, "disk": 2}  # each edge alone: 3/4/0
    # a pipeline stage's slots are the whole model's
    whole = slot_tier_counts(Split(0.3, 0.3, 0.4), [6, 6, 4], range(5))
    assert slot_tier_counts(Split(0.3, 0.3, 0.4), [6, 6, 4], [3, 4]) == {s: c for s, c in whole.items() if s[0] >= 3}


def test_a_resident_layer_loads_as_its_homes_and_a_streamed_one_loads_again(tiny_llama, tmp_path):
    """A layer whose weights live whole on the compute device loads as those very tensors,
    kept from its first load (ModelRuntime.load_layer); a layer with weights on disk reads
    them again at every load, never served from that keep."""
    def runtime(weights: Split):
        return Engine.load(str(tiny_llama), Policy(weights=weights), dtype="float32", device="cpu",
                           offload_dir=tmp_path, progress=False).runtime

    resident = runtime(Split(1, 0, 0))
    for layer in resident.layers:
        first, again = resident.load_layer(layer), resident.load_layer(layer)
        assert all(first[t.key] is resident.homes[t.store_name].data[0] is again[t.key] for t in layer.tensors)
    streamed = runtime(Split(0.5, 0, 0.5))  # every layer has a weight on disk (placement cuts each layer)
    on_disk = 0
    for layer in streamed.layers:
        first, again = streamed.load_layer(layer), streamed.load_layer(layer)
        for t in layer.tensors:
            if any(p is None for p in streamed.homes[t.store_name].data):
                on_disk += 1
                assert first[t.key] is not again[t.key] and torch.equal(first[t.key], again[t.key])
    assert on_disk
