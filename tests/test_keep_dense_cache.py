"""A compressed cache whose values are held dense (Policy.keep_dense_cache), so that a decode
step does not dequantize every held position again: stored dense and read in place, per-token
groups rounded as written, a KIVI cache's groups rounded in place once complete. A run
computes with the numbers of the compressed cache (float32: the same tokens, log-probs to
rounding); the planner counts what it holds, and turns it on only where it fits and is faster."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_keep_dense_weights import DENSE, GIB, OPT13
from test_prefix_sharing import PROMPTS as SHARED_PREFIX_PROMPTS

from flexgen_helm.compression.kivi import as_stored
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
# groups of 3 tokens: several complete within the tests' runs (of 2, a 4-bit min/max grid gives
# both values back, so a group skipped or rounded in the wrong rows would not show)
KIVI4 = Compression(4, 3, cache_grouping="kivi")
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
    "kivi-cache-split": Policy(2, 2, cache=Split(0.5, 0.5, 0), compress_cache=KIVI4),
    # groups wider than Gemma 3's sliding window (4): its rings keep a whole group
    "kivi-groups-wider-than-the-window": Policy(4, 1, compress_cache=Compression(4, 6, cache_grouping="kivi")),
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


@pytest.mark.parametrize("name", ["cache-split-delegated-no-overlap", "kivi-one-batch",
                                  "kivi-groups-wider-than-the-window"])
@pytest.mark.parametrize("model", ["tiny_opt", "tiny_gemma3"])
def test_other_families_and_sliding_windows(model, request, tmp_path, name):
    """OPT's biases and learned positions; Gemma 3's sliding-window blocks, whose slots are
    rings of their window (per-token: rounded as written, like any row; KIVI: a ring that
    keeps at least a group's G positions, to round it from all of them)."""
    _check_same(request.getfixturevalue(model), POLICIES[name], tmp_path, PROMPTS)


@pytest.mark.parametrize("sparsity", [1.0, 0.5])
@pytest.mark.parametrize("cache", [KV8, Compression(4, 20, cache_grouping="kivi")], ids=["per-token", "kivi"])
def test_a_shared_prefix_is_held_rounded_too(tiny_llama, tmp_path, sparsity, cache):
    """The block's one copy of a shared prefix holds the values every row's slot would (KIVI:
    its complete groups, rounded; the partial group after them is each row's own)."""
    _check_same(tiny_llama, Policy(4, 2, compress_cache=cache, attn_sparsity=sparsity), tmp_path,
                SHARED_PREFIX_PROMPTS)


def test_a_kivi_cache_held_dense_is_read_in_place_and_rounds_each_group_once(tiny_llama, tmp_path, monkeypatch):
    """No unpack at any decode step; each unit's group rounded once, when its last position is
    written (units of different paddings complete theirs at different steps), whatever the
    step; a decode step's position, written in place before attention, is written again only
    at a step that rounds a group; usage back where it was once the block is done."""
    from flexgen_helm.executor import kv_cache
    rounded, unpacked, decode_writes = [], [], []
    real, real_write = kv_cache.rounded_groups, KVCacheSlot.write
    monkeypatch.setattr(kv_cache, "rounded_groups", lambda k, v, cfg: rounded.append(k.shape[1]) or real(k, v, cfg))
    monkeypatch.setattr(KVCacheSlot, "unpack", lambda *a: unpacked.append(a))

    def write(slot, k, *args, **kwargs):
        before = len(rounded)
        real_write(slot, k, *args, **kwargs)
        if k.shape[0] == 1:
            decode_writes.append(len(rounded) - before)

    monkeypatch.setattr(KVCacheSlot, "write", write)
    policy = Policy(4, 1, compress_cache=KIVI4, keep_dense_cache=True)
    engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cpu", offload_dir=tmp_path, progress=False)
    before = {t: engine.runtime.usage.current[t] for t in ("gpu", "cpu", "disk")}
    new = 5
    # paddings 0 and 2: groups of 3 complete at decode positions 8 and 7, none at 6 and 9
    prompts = [PROMPTS[0], [3, 8, 1, 4]]
    engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    assert {t: engine.runtime.usage.current[t] for t in ("gpu", "cpu", "disk")} == before
    assert not unpacked
    # every position but the last token's is written
    groups = sum((len(p) + new - 1) // KIVI4.group_size for p in prompts)
    assert sum(rounded) == groups * engine.config.num_kv_heads * engine.config.num_layers
    assert len(rounded) > engine.config.num_layers  # the prefill's, then decode steps'
    assert decode_writes and all(decode_writes)  # each decode write rounded a completed group
    assert len(decode_writes) == 2 * engine.config.num_layers


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


@pytest.mark.parametrize("window", [0, 3])
def test_a_kivi_slot_held_dense_holds_what_kivi_returns(window):
    """Bit for bit, a KIVI cache's values (kivi.as_stored) where a unit's group is complete,
    and the values as computed in its unfinished group (KIVI's residual), groups counted from
    each unit's first real position: written by a prefill, then by decode steps one position
    at a time (one completing groups of two units, a step later another's); a sliding
    window's ring keeps a whole group, which it rounds from all its positions."""
    devices = Devices(torch.device("cpu"), torch.float32)
    cfg, d, t = Compression(4, 4, cache_grouping="kivi"), 8, 13
    starts = torch.tensor([0, 2, 3, 3])
    slot = KVCacheSlot({"gpu": 4, "cpu": 0, "disk": 0}, 16, d, devices, TierUsage(), None, False, window=window,
                       rounding=cfg, starts=starts)
    k, v = torch.randn(t, 4, d), torch.randn(t, 4, d)
    slot.write(k[:6], v[:6], 0)
    for p in range(6, t):
        slot.write(k[p:p + 1], v[p:p + 1], p)
    want = [x.transpose(0, 1) for x in as_stored(k.transpose(0, 1), v.transpose(0, 1), cfg, starts, torch.float32)]
    complete = (torch.arange(t)[:, None] - starts[None, :]) < (t - starts) // cfg.group_size * cfg.group_size
    for got, rounded, fresh in zip(slot.read("gpu", t), want, (k, v)):
        expected = torch.where(complete[..., None], rounded, fresh)[slot.first_held(t):]
        assert torch.equal(got, expected)
        assert not torch.equal(got, fresh[slot.first_held(t):])  # something was rounded



@pytest.mark.parametrize("window", [0, 3])
def test_kivi_slots_split_over_other_tiers_hold_the_same_values_written_in_turn(window):
    """The layers of a GPU batch write the same positions in turn, and the plan of which
    groups a write completes is worked out once for the slots it fits (KVCacheSlot._group_plan):
    slots whose units lie on other tiers each hold what KIVI returns, written alternately."""
    devices = Devices(torch.device("cpu"), torch.float32)
    cfg, d, t = Compression(4, 4, cache_grouping="kivi"), 8, 13
    starts = torch.tensor([0, 2, 3, 3])
    splits = [{"gpu": 4, "cpu": 0, "disk": 0}, {"gpu": 1, "cpu": 3, "disk": 0}, {"gpu": 3, "cpu": 1, "disk": 0}]
    slots = [KVCacheSlot(units, 16, d, devices, TierUsage(), None, False, window=window, rounding=cfg, starts=starts)
             for units in splits]
    k, v = torch.randn(t, 4, d), torch.randn(t, 4, d)
    for slot in slots:
        slot.write(k[:6], v[:6], 0)
    for p in range(6, t):
        for slot in slots:
            slot.write(k[p:p + 1], v[p:p + 1], p)
    want = [x.transpose(0, 1) for x in as_stored(k.transpose(0, 1), v.transpose(0, 1), cfg, starts, torch.float32)]
    complete = (torch.arange(t)[:, None] - starts[None, :]) < (t - starts) // cfg.group_size * cfg.group_size
    for slot in slots:
        tiers = [slot.read(tier, t) for tier in ("gpu", "cpu") if slot.units[tier]]
        for j, (rounded, fresh) in enumerate(zip(want, (k, v))):
            got = torch.cat([held[j] for held in tiers], dim=1)
            assert torch.equal(got, torch.where(complete[..., None], rounded, fresh)[slot.first_held(t):])

def test_what_a_dense_cache_cannot_do_is_refused():
    with pytest.raises(PolicyError, match="compress_cache is not set"):
        Policy(keep_dense_cache=True)
    with pytest.raises(PolicyError, match=r"KIVI cache held dense rounds each group in place .* 50% on disk"):
        Policy(compress_cache=Compression(4, 64, cache_grouping="kivi"), cache=Split(0.5, 0, 0.5),
               keep_dense_cache=True)
    with pytest.raises(ValueError, match="rounds its writes only when it stores them dense"):
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
    cache fits the block, it keeps it compressed; a KIVI cache likewise, all on the top tier."""
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
    assert bf16.policy.keep_dense_cache  # bf16 values round once more than a CPU's float32 reads: still held
    kivi = dict(pinned, gpu_batch_size=8, compress_cache=Compression(8, 64, cache_grouping="kivi"))
    held_dense = search(OPT13, prof, 512, 64, default_budgets(prof), SearchOptions(**kivi))
    assert held_dense.policy.keep_dense_cache and held_dense.policy.cache.gpu == 1.0
    assert not search(OPT13, prof, 512, 64, tight, SearchOptions(**kivi)).policy.keep_dense_cache
    with pytest.raises(PolicyError, match="keep_dense_cache: no block fits the budgets .* drop --keep-dense-cache"):
        search(OPT13, prof, 512, 64, tight, SearchOptions(**kivi, keep_dense_cache=True))


@pytest.mark.parametrize("held_out", [None, (2, 5)])
def test_a_per_token_rewrite_of_packed_units_writes_what_the_general_write_does(held_out):
    """A decode step's rewrite once some sequences finished, over two tiers read in place
    (KVCacheSlot._rewrite_packed: the computed units' rows alone, rounded and copied to the
    packed columns): bit for bit the general write's rows (all units scattered, rounded, the
    packed ones picked back out), around a held-out shared prefix too."""
    devices = Devices(torch.device("cpu"), torch.float32)
    units, d = {"gpu": 4, "cpu": 3, "disk": 0}, 8
    rounding = Compression(8, 8, cache_grouping="per-token")
    held, fast_writes = {}, []
    for path in ("packed", "general"):
        slot = KVCacheSlot(units, 12, d, devices, TierUsage(), None, False, held_out=held_out, rounding=rounding)
        if path == "general":
            slot._rewrites_packed = lambda positions, tiers: False
        else:
            rewrite = slot._rewrite_packed
            slot._rewrite_packed = lambda *args, _rewrite=rewrite: (fast_writes.append(args[2]), _rewrite(*args))
        torch.manual_seed(0)
        prompt = torch.randn(6, 7, d)
        slot.write(prompt, prompt.clone(), 0)
        for position, computed in ((6, [0, 2, 3, 5, 6]), (7, [2, 5, 6]), (8, [5])):
            live = torch.tensor(computed)
            k, v = torch.randn(len(live), 1, d), torch.randn(len(live), 1, d)
            tiers = []
            for tier in ("gpu", "cpu"):
                a, b = slot.ranges[tier]
                mine = (live >= a) & (live < b)
                if mine.any():
                    slot.append_in_place(tier, k[mine], v[mine], position, live[mine] - a)
                    tiers.append(tier)
            slot.write(k.transpose(0, 1), v.transpose(0, 1), position, live, tuple(tiers))
            held[path, position] = {tier: (slot.k[tier][:slot._row(position) + 1, :len(slot._packed[tier])].clone(),
                                           slot.v[tier][:slot._row(position) + 1, :len(slot._packed[tier])].clone())
                                    for tier in tiers}
    assert fast_writes == [6, 7, 8]  # every step's rewrite took the packed path
    for position in (6, 7, 8):
        for tier, (k, v) in held["packed", position].items():
            assert torch.equal(k, held["general", position][tier][0])
            assert torch.equal(v, held["general", position][tier][1])


@pytest.mark.parametrize("gbs, nb", [(1, 4), (2, 2), (4, 1)], ids=["four-batches", "two-batches-units-packed",
                                                              "one-batch"])
@pytest.mark.parametrize("cache", [KV8, KV4], ids=["8bit", "4bit"])
@pytest.mark.parametrize("bound", [None, 300], ids=["whole-steps", "bounded"])
def test_a_steps_writes_of_every_layer_and_batch_round_in_one_call_to_the_same_bits(tiny_llama, tmp_path, monkeypatch,
                                                                                   cache, gbs, nb, bound):
    """A per-token cache held dense rounds the new positions of a decode step, every layer's
    and GPU batch's, in one call at the step's end (BlockSchedule._write_rounded_together):
    each position and unit is its own group, so the run's every token and log-prob is the one
    of each write rounding itself (in blocks of two, a batch whose sequences stop apart writes
    its running units packed). Bounded (ROUNDED_TOGETHER_ELEMENTS), the writes waiting are
    rounded whenever they reach the bound."""
    from flexgen_helm.executor import schedule

    if bound is not None:
        monkeypatch.setattr(schedule, "ROUNDED_TOGETHER_ELEMENTS", bound)
    policy = Policy(gbs, nb, compress_cache=cache, keep_dense_cache=True)
    calls, held = [], []  # per call: the writes it rounded, and their elements
    together = schedule.BlockSchedule._write_rounded_together

    def counted(self, stage):
        calls.append(len(self._rounding_writes))
        held.append([2 * kv[0].numel() for _, _, kv in self._rounding_writes])
        return together(self, stage)

    # the sequences stop at their own steps: the later steps write the batches still running
    prompts = [[5, 17, 42, 7, 99], [3, 8, 1, 4, 4], [9, 9, 4, 2, 11], [6, 1, 30, 2, 8]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, top_logprobs=2) for n in (6, 2, 6, 3)]

    def run(where):
        engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cpu", offload_dir=where,
                             progress=False)
        return engine, [r.completions[0] for r in engine.generate(prompts, params).results]

    packed_rewrites = []
    rewrite = KVCacheSlot._rewrite_packed

    def spied(self, k, v, start, units, tiers, rounded=False):
        packed_rewrites.append(rounded)
        return rewrite(self, k, v, start, units, tiers, rounded)

    monkeypatch.setattr(schedule.BlockSchedule, "_write_rounded_together", counted)
    monkeypatch.setattr(KVCacheSlot, "_rewrite_packed", spied)
    engine, together_bits = run(tmp_path / "together")
    layers = engine.config.num_layers
    if bound is None:
        assert calls[0] == 0  # a prefill's round as they are stored
        assert max(calls) == layers * nb  # a decode step's, of every layer and batch, in one call
    else:  # rounded as soon as they reach the bound: each call's writes but the last within it
        assert max(calls) > 1 and all(sum(e[:-1]) < bound for e in held if e)
    assert any(packed_rewrites) == (gbs > 1)  # units of a batch written packed, pre-rounded
    monkeypatch.setattr(schedule.BlockSchedule, "_rounds_together", lambda self, index, k, new_kv: False)
    _, apart = run(tmp_path / "apart")
    for a, b in zip(together_bits, apart):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
