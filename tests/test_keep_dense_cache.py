"""A compressed cache whose values are held dense (Policy.keep_dense_cache), so that a decode
step does not dequantize every held position again: per-token groups rounded as written and
stored dense, read in place; a KIVI cache's groups mirrored dense beside them, each step adding
the groups it completed. A run computes with the numbers of the compressed cache (float32: the
same tokens, log-probs to rounding); the planner counts what it holds, and turns it on only
where it fits and is faster."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_keep_dense_weights import DENSE, GIB, OPT13
from test_prefix_sharing import PROMPTS as SHARED_PREFIX_PROMPTS

from flexgen_helm.compression.quantize import fake_quantize
from flexgen_helm.engine import Engine
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.executor.kv_cache import KVCacheSlot
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile
from flexgen_helm.planner.search import Budgets, SearchOptions, default_budgets, search
from flexgen_helm.policy import Compression, Policy, Split

KV8 = Compression(8, 8, cache_grouping="per-token")
KV4 = Compression(4, 4, cache_grouping="per-token")
KIVI4 = Compression(4, 2, cache_grouping="kivi")  # groups of 2 tokens: several complete within the tests' runs
PROMPTS = [[5, 17, 42, 7, 99, 3], [3, 8, 1], [9, 9, 4, 2, 11]]

POLICIES = {
    "one-batch-8bit": Policy(4, 1, compress_cache=KV8),
    "merged-batches-4bit": Policy(1, 3, compress_cache=KV4),
    "cache-split-delegated-no-overlap": Policy(2, 2, cache=Split(0.3, 0.3, 0.4), cpu_cache_compute=True,
                                               overlap=False, compress_cache=KV4),
    "sparse-cache-on-disk": Policy(2, 2, cache=Split(0, 0.5, 0.5), attn_sparsity=0.5, compress_cache=KV8),
    "kivi-one-batch": Policy(4, 1, compress_cache=KIVI4),
    "kivi-merged-batches-delegated-no-overlap": Policy(1, 3, compress_cache=KIVI4, cpu_cache_compute=True,
                                                       overlap=False),
    "kivi-sparse": Policy(2, 2, compress_cache=Compression(8, 3, cache_grouping="kivi"), attn_sparsity=0.5),
}


def _generate(path, policy: Policy, tmp_path, prompts) -> list:
    engine = Engine.load(str(path), policy, dtype="float32", device="cpu", offload_dir=tmp_path, progress=False)
    run = engine.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True, top_logprobs=2))
    return [r.completions[0] for r in run.results]


def _check_same(path, policy: Policy, tmp_path, prompts) -> None:
    stored, dense = (_generate(path, dataclasses.replace(policy, keep_dense_cache=keep), tmp_path / str(keep),
                               prompts) for keep in (False, True))
    for a, b in zip(stored, dense):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_cache_held_dense_computes_what_the_compressed_cache_computes(tiny_llama, tmp_path, name):
    _check_same(tiny_llama, POLICIES[name], tmp_path, PROMPTS)


@pytest.mark.parametrize("name", ["cache-split-delegated-no-overlap", "kivi-one-batch"])
@pytest.mark.parametrize("model", ["tiny_opt", "tiny_gemma3"])
def test_other_families_and_sliding_windows(model, request, tmp_path, name):
    """OPT's biases and learned positions; Gemma 3's sliding-window blocks, whose slots are
    rings of their window (per-token: rounded as written, like any row; KIVI: a ring of group
    slots, each rewritten slot mirrored again)."""
    _check_same(request.getfixturevalue(model), POLICIES[name], tmp_path, PROMPTS)


@pytest.mark.parametrize("sparsity", [1.0, 0.5])
@pytest.mark.parametrize("cache", [KV8, Compression(4, 20, cache_grouping="kivi")], ids=["per-token", "kivi"])
def test_a_shared_prefix_is_held_rounded_too(tiny_llama, tmp_path, sparsity, cache):
    """The block's one copy of a shared prefix holds the values every row's slot would (KIVI:
    its complete groups, held as ever; a row's own groups mirrored)."""
    _check_same(tiny_llama, Policy(4, 2, compress_cache=cache, attn_sparsity=sparsity), tmp_path,
                SHARED_PREFIX_PROMPTS)


def test_a_held_kivi_prefix_is_dequantized_once_a_block(tiny_llama, tmp_path, monkeypatch):
    """Held dense, the shared prefix's groups are dequantized once for each layer, not at every
    decode step; usage back where it was once the block is done."""
    from flexgen_helm.executor.held_prefix import HeldPrefix
    calls = []
    real = HeldPrefix.unpack
    monkeypatch.setattr(HeldPrefix, "unpack", lambda self, dtype, buffers: calls.append(buffers) or real(
        self, dtype, buffers))
    policy = Policy(16, 1, compress_cache=Compression(4, 20, cache_grouping="kivi"), keep_dense_cache=True)
    engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cpu", offload_dir=tmp_path, progress=False)
    before = {t: engine.runtime.usage.current[t] for t in ("gpu", "cpu", "disk")}
    engine.generate(SHARED_PREFIX_PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(calls) == engine.config.num_layers and calls == [None] * len(calls)
    assert {t: engine.runtime.usage.current[t] for t in ("gpu", "cpu", "disk")} == before


def test_a_kivi_mirror_adds_only_the_groups_a_step_completed(tiny_llama, tmp_path, monkeypatch):
    """The mirror's first step dequantizes the group slots the prefill wrote; later steps only
    the one a unit just completed (a slot's groups complete at different steps for units of
    different paddings): fewer groups in all than the compressed cache dequantizes, every held
    group at every step, and usage back where it was once the block is done."""
    from flexgen_helm.compression.kivi import KiviGroups
    groups = {}
    real = KiviGroups.dequantize_into
    for keep in (False, True):
        done = groups[keep] = []
        monkeypatch.setattr(KiviGroups, "dequantize_into", lambda self, k, v, s=None, done=done: done.append(
            self.groups) or real(self, k, v, s))
        policy = Policy(4, 1, compress_cache=KIVI4, keep_dense_cache=keep)
        engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cpu", offload_dir=tmp_path / str(keep),
                             progress=False)
        before = {t: engine.runtime.usage.current[t] for t in ("gpu", "cpu", "disk")}
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True))
        assert {t: engine.runtime.usage.current[t] for t in ("gpu", "cpu", "disk")} == before
    assert set(groups[True]) == {1}  # slot by slot
    assert 0 < sum(groups[True]) < sum(groups[False])


def test_writes_hold_the_values_a_compressed_slot_returns():
    """Bit for bit, prefill rows and a decode step's one position alike; and the dense cache
    is read in place (no unpack per step)."""
    devices = Devices(torch.device("cpu"), torch.float32)
    units, d = {"gpu": 3, "cpu": 0, "disk": 0}, 8
    args = (units, 10, d, devices, TierUsage(), None, False)
    compressed = KVCacheSlot(*args, compression=KV4)
    dense = KVCacheSlot(*args, rounding=KV4)
    k, v = torch.randn(7, 3, d), torch.randn(7, 3, d)
    for slot in (compressed, dense):
        slot.write(k[:6], v[:6], 0)
        slot.write(k[6:], v[6:], 6)
    want = compressed.unpack("gpu", compressed.read("gpu", 7), torch.device("cpu"), torch.float32, CacheBuffers(1))
    got = dense.read("gpu", 7)
    assert torch.equal(want[0][:, :7], got[0].transpose(0, 1))
    assert torch.equal(want[1][:, :7], got[1].transpose(0, 1))
    assert torch.equal(got[0][:6], fake_quantize(k[:6], KV4, 2))
    assert dense.in_place("gpu", torch.device("cpu")) and not compressed.in_place("gpu", torch.device("cpu"))


def test_what_a_dense_cache_cannot_do_is_refused():
    with pytest.raises(PolicyError, match="compress_cache is not set"):
        Policy(keep_dense_cache=True)
    with pytest.raises(PolicyError, match=r"KIVI cache holds its dense copy .* 50% off the gpu tier"):
        Policy(compress_cache=Compression(4, 64, cache_grouping="kivi"), cache=Split(0.5, 0.5, 0),
               keep_dense_cache=True)
    with pytest.raises(ValueError, match="per-token grid only when it stores them dense"):
        KVCacheSlot({"gpu": 1, "cpu": 0, "disk": 0}, 4, 8, Devices(torch.device("cpu"), torch.float32), TierUsage(),
                    None, False, compression=KV4, rounding=KV4)


def _profile() -> HardwareProfile:
    """A CPU computing in float32: per-token values held dense are the compressed cache's."""
    cpu = DeviceSpeeds({"float32": DENSE}, dequant_elems_per_s=5e8)
    return HardwareProfile(devices={"cpu": cpu}, memcpy_bytes_per_s=5e9, disk_read_bytes_per_s=1e9,
                           disk_write_bytes_per_s=5e8, cpu_mem_bytes=24 * GIB, cpu_available_bytes=20 * GIB,
                           disk_free_bytes=100 * GIB, dtype="float32")


def test_the_search_holds_the_cache_dense_only_where_it_fits_and_pays():
    """A compressed cache dequantizes every held position at each decode step: with room for
    the dense cache the search holds it dense (counted at its size); where only the compressed
    cache fits the block, it keeps it compressed; a KIVI cache is mirrored where it is all on the
    gpu tier and the mirror fits."""
    prof = _profile()
    pinned = dict(gpu_batch_size=32, num_gpu_batches=1, compress_cache=Compression(8, 64, cache_grouping="per-token"))
    roomy = search(OPT13, prof, 512, 64, default_budgets(prof), SearchOptions(**pinned))
    assert roomy.policy.keep_dense_cache
    model = CostModel(OPT13, prof, Workload(512, 64))
    stored = model.estimate(dataclasses.replace(roomy.policy, keep_dense_cache=False))
    assert roomy.estimate.decode_step_s < stored.decode_step_s
    dense_cache, compressed_cache = (sum(e.peak_bytes["decode"].values()) for e in (roomy.estimate, stored))
    assert dense_cache > compressed_cache + GIB  # 32 x 576 positions x 24 layers: 7.2 GB dense, 1.9 GB in 8 bits
    tight = Budgets(gpu=5 * GIB, cpu=7 * GIB, disk=0)
    assert not search(OPT13, prof, 512, 64, tight, SearchOptions(**pinned)).policy.keep_dense_cache
    bf16 = search(OPT13, prof, 512, 64, default_budgets(prof), SearchOptions(**pinned), dtype=torch.bfloat16)
    assert not bf16.policy.keep_dense_cache  # a CPU's attention reads float32: bf16 values would round again
    kivi = dict(pinned, gpu_batch_size=8, compress_cache=Compression(8, 64, cache_grouping="kivi"))
    mirrored = search(OPT13, prof, 512, 64, default_budgets(prof), SearchOptions(**kivi))
    assert mirrored.policy.keep_dense_cache and mirrored.policy.cache.gpu == 1.0
    assert not search(OPT13, prof, 512, 64, tight, SearchOptions(**kivi)).policy.keep_dense_cache
    with pytest.raises(PolicyError, match="keep_dense_cache: no block fits the budgets .* drop --keep-dense-cache"):
        search(OPT13, prof, 512, 64, tight, SearchOptions(**kivi, keep_dense_cache=True))
