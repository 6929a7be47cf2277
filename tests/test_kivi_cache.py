"""The KIVI-grouped KV cache (keys per channel over groups of tokens, values per token, an
unfinished group in full precision): what a slot returns is the simulated quantization of
each sequence's own keys and values, on every tier and through a sliding window's ring; a
decode step's buffers are reused; settings it cannot take are refused before loading.
(Policy invariance and scoring-as-decode = generation: tests/test_compression_engine.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from flexgen_helm import engine as engine_module
from flexgen_helm.compression import fake_quantize
from flexgen_helm.compression.quantize import dequantize, dequantize_into, quantize
from flexgen_helm.engine import Engine
from flexgen_helm.errors import FlexGenError, PolicyError
from flexgen_helm.executor import schedule
from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.executor.held_prefix import HeldPrefix
from flexgen_helm.executor.kivi_cache import KiviCacheSlot
from flexgen_helm.executor.kv_cache import kv_nbytes
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy import Policy, Split
from flexgen_helm.policy.policy import DEFAULT_CACHE_GROUPING, Compression

CPU32 = dict(dtype="float32", device="cpu", progress=False)
D = 8


def _reference(k, v, start, have, cfg, window):
    """A unit's keys and values as a decode step at real position `have` sees them: its
    complete groups quantized (keys along the tokens, values along head_dim), the rest exact,
    the oldest dropped beyond a window."""
    G = cfg.group_size
    keys, values = k[start:start + have].clone(), v[start:start + have].clone()
    done = have // G * G
    if done:
        keys[:done] = fake_quantize(keys[:done], Compression(cfg.bits, G), 0)
        values[:done] = fake_quantize(values[:done], Compression(cfg.bits, min(G, D)), 1)
    first = max(0, have + 1 - window) if window else 0
    return keys[first:], values[first:]


def _attention(q, keys, values):
    w = (q @ keys.T / math.sqrt(q.shape[-1])).softmax(-1)
    return w @ values


@pytest.mark.parametrize("window", [0, 6], ids=["all", "ring"])
@pytest.mark.parametrize("bits, group", [(4, 4), (3, 3)])
def test_slot_returns_each_sequence_quantized_in_its_own_groups(window, bits, group, tmp_path):
    cfg = Compression(bits, group, cache_grouping="kivi")
    units, max_len = {"gpu": 3, "cpu": 2, "disk": 3}, 20
    starts = torch.tensor([0, 2, 5, 5, 1, 0, 7, 3])  # left padding of each unit's sequence
    usage = TierUsage()
    slot = KiviCacheSlot(units, max_len, D, Devices(torch.device("cpu"), torch.float32), usage, tmp_path / "kv.bin",
                         pin=False, compression=cfg, window=window, starts=starts)
    rows = min(max_len, window) if window else max_len
    for tier, n in units.items():
        assert usage.current[tier] == kv_nbytes(rows, n, D, torch.float32, cfg)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(max_len, 8, D, generator=g), torch.randn(max_len, 8, D, generator=g) * 3 + 1
    k[:, :, 2] *= 20  # an outlier channel, as keys have
    slot.write(k[:9], v[:9], 0)  # a prefill, then one token at a time
    buffers = CacheBuffers(sets=1)
    for length in range(9, max_len):
        for tier, (a, b) in slot.ranges.items():
            keys, values = slot.unpack(tier, slot.read(tier, length), torch.device("cpu"), torch.float32, buffers)
            keys[:, -1], values[:, -1] = k[length, a:b], v[length, a:b]
            drop, valid = slot.decode_valid(tier, length, window, torch.ones(b - a, length + 1, dtype=torch.bool),
                                            None)
            assert drop == 0
            q = torch.randn(b - a, 2, D, generator=g)
            for i, u in enumerate(range(a, b)):
                have = length - int(starts[u])
                ref_k, ref_v = _reference(k[:, u], v[:, u], int(starts[u]), have, cfg, window)
                assert int(valid[i].sum()) == len(ref_k) + 1
                got = _attention(q[i], keys[i][valid[i]], values[i][valid[i]])
                want = _attention(q[i], torch.cat([ref_k, k[length, u][None]]), torch.cat([ref_v, v[length, u][None]]))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        slot.write(k[length:length + 1], v[length:length + 1], length)
    slot.close()
    assert all(n == 0 for n in usage.current.values())


@pytest.mark.parametrize("bits, group", [(4, 4), (3, 3)])
def test_a_slot_holding_out_a_shared_prefix_keeps_the_rest_and_its_copy_the_prefix(bits, group, tmp_path):
    """Sequences whose prompts start with the same P tokens: every unit's first P // G groups
    are the prefix's, alike in every row, so the slot holds them out (that much smaller) and
    the block's one copy (HeldPrefix) gives them back exactly; together, a decode step sees
    each unit's cache quantized as before, the prefix's partial group the unit's own."""
    cfg, kvh, held_groups = Compression(bits, group, cache_grouping="kivi"), 2, 2
    P = held_groups * group + 1  # the prefix's last token: in each row's own, partial group
    units, max_len = {"gpu": 3, "cpu": 2, "disk": 3}, 24
    starts = torch.tensor([0, 2, 5, 1]).repeat_interleave(kvh)  # each sequence's padding, for its kv heads
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(max_len, 8, D, generator=g), torch.randn(max_len, 8, D, generator=g) * 3 + 1
    prefix_k, prefix_v = torch.randn(kvh, P, D, generator=g), torch.randn(kvh, P, D, generator=g)
    for u in range(8):
        k[starts[u]:starts[u] + P, u], v[starts[u]:starts[u] + P, u] = prefix_k[u % kvh], prefix_v[u % kvh]
    usage = TierUsage()
    slot = KiviCacheSlot(units, max_len, D, Devices(torch.device("cpu"), torch.float32), usage, tmp_path / "kv.bin",
                         pin=False, compression=cfg, window=0, starts=starts, held_out_groups=held_groups)
    for tier, n in units.items():
        assert usage.current[tier] == kv_nbytes(max_len - held_groups * group, n, D, torch.float32, cfg)
    held = HeldPrefix(prefix_k, prefix_v, cfg, torch.float32, torch.device("cpu"))
    assert held.length == held_groups * group
    held_k, held_v = held.unpack(torch.float32, CacheBuffers(sets=1))
    prompt = int(starts.max()) + P + 1
    slot.write(k[:prompt], v[:prompt], 0)
    buffers = CacheBuffers(sets=1)
    for length in range(prompt, max_len):
        for tier, (a, b) in slot.ranges.items():
            keys, values = slot.unpack(tier, slot.read(tier, length), torch.device("cpu"), torch.float32, buffers)
            keys[:, -1], values[:, -1] = k[length, a:b], v[length, a:b]
            _, valid = slot.decode_valid(tier, length, 0, torch.ones(b - a, length + 1, dtype=torch.bool), None)
            q = torch.randn(b - a, 2, D, generator=g)
            for i, u in enumerate(range(a, b)):
                ref_k, ref_v = _reference(k[:, u], v[:, u], int(starts[u]), length - int(starts[u]), cfg, 0)
                got = _attention(q[i], torch.cat([held_k[u % kvh], keys[i][valid[i]]]),
                                 torch.cat([held_v[u % kvh], values[i][valid[i]]]))
                want = _attention(q[i], torch.cat([ref_k, k[length, u][None]]), torch.cat([ref_v, v[length, u][None]]))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        slot.write(k[length:length + 1], v[length:length + 1], length)
    slot.close()


def test_batches_unpacked_together_equal_each_alone(tmp_path):
    """A merged decode step unpacks a layer's GPU batches in one call where their reads hold
    the same positions: each batch gets exactly what its own unpack gives, whether its
    positions match another batch's (two of these three) or not (the third: its longer
    padding leaves it a group fewer)."""
    cfg = Compression(4, 4, cache_grouping="kivi")
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(2)
    batch_starts = [torch.tensor([0, 1, 1]), torch.tensor([1, 0]), torch.tensor([6, 5, 7, 6])]
    slots, stored = [], []
    for i, starts in enumerate(batch_starts):
        slot = KiviCacheSlot({"gpu": len(starts), "cpu": 0, "disk": 0}, 16, D,
                             Devices(cpu, torch.float32), TierUsage(), tmp_path / f"kv{i}.bin", pin=False,
                             compression=cfg, window=0, starts=starts)
        slot.write(torch.randn(13, len(starts), D, generator=g), torch.randn(13, len(starts), D, generator=g), 0)
        slots.append(slot)
        stored.append(slot.read("gpu", 13))
    assert [x.positions for x in stored] == [16, 16, 12]
    together = slots[0].unpack_batches("gpu", stored, cpu, torch.float32, [CacheBuffers(sets=1) for _ in stored])
    for slot, x, (keys, values) in zip(slots, stored, together):
        alone_k, alone_v = slot.unpack("gpu", x, cpu, torch.float32, CacheBuffers(sets=1))
        assert keys.shape == alone_k.shape and values.shape == alone_v.shape
        assert torch.equal(keys[:, :-1], alone_k[:, :-1]) and torch.equal(values[:, :-1], alone_v[:, :-1])
    for slot in slots:
        slot.close()


def test_finished_units_leave_the_others_alone(tmp_path):
    """A write of some units (finished sequences left the batch) zeroes the others' rows,
    which nobody reads again; the computed units' caches stay exact."""
    cfg = Compression(4, 4, cache_grouping="kivi")
    starts = torch.tensor([0, 1, 2, 3])
    slot = KiviCacheSlot({"gpu": 2, "cpu": 0, "disk": 2}, 16, D, Devices(torch.device("cpu"), torch.float32),
                         TierUsage(), tmp_path / "kv.bin", pin=False, compression=cfg, window=0, starts=starts)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(16, 4, D, generator=g), torch.randn(16, 4, D, generator=g)
    slot.write(k[:6], v[:6], 0)
    kept = torch.tensor([0, 3])
    for length in range(6, 12):
        slot.write(k[length:length + 1, kept], v[length:length + 1, kept], length, units=kept)
    buffers = CacheBuffers(sets=1)
    for tier, unit, local in (("gpu", 0, torch.tensor([0])), ("disk", 3, torch.tensor([1]))):
        keys, values = slot.unpack(tier, slot.read(tier, 12), torch.device("cpu"), torch.float32, buffers)
        keys, values = keys[local], values[local]
        _, valid = slot.decode_valid(tier, 12, 0, torch.ones(1, 13, dtype=torch.bool), local)
        ref_k, ref_v = _reference(k[:, unit], v[:, unit], int(starts[unit]), 12 - int(starts[unit]), cfg, 0)
        q = torch.randn(2, D, generator=g)
        got = _attention(q, keys[0][valid[0]][:-1], values[0][valid[0]][:-1])
        torch.testing.assert_close(got, _attention(q, ref_k, ref_v), rtol=1e-5, atol=1e-5)
    slot.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits, group, group_dim, shape", [(4, 64, 2, (37, 6, 64)), (3, 5, 2, (11, 3, 8)),
                                                           (4, 4, 0, (16, 5, 8)), (2, 8, 3, (3, 4, 8, 16)),
                                                           (8, 64, 2, (37, 6, 64)), (8, 5, 2, (11, 3, 8)),
                                                           (8, 4, 0, (16, 5, 8))])
def test_dequantize_into_a_strided_buffer_equals_dequantize(dtype, bits, group, group_dim, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    q = quantize(x, Compression(bits, group), group_dim)
    out = torch.empty(tuple(reversed(shape)), dtype=dtype).permute(*reversed(range(len(shape))))  # every stride odd
    assert torch.equal(dequantize_into(q, out), dequantize(q, dtype))
    assert torch.equal(dequantize_into(q, torch.empty(shape)), dequantize(q, torch.float32))


class _Recorded(CacheBuffers):
    made: list = []

    def __init__(self, sets: int):
        super().__init__(sets)
        _Recorded.made.append(self)


@pytest.mark.parametrize("grouping", ["per-token", "kivi"])
def test_decode_steps_reuse_their_buffers(tiny_llama, grouping, tmp_path, monkeypatch):
    """The dequantized cache goes into buffers allocated in the first decode steps (and, under
    KIVI, when two batches' reads first hold the same positions and unpack together: the
    shared working copies grow once), not at every layer of every step: 12 steps and 20
    steps allocate alike (positions stay within the first buffers' doubled size)."""
    monkeypatch.setattr(schedule, "CacheBuffers", _Recorded)
    policy = Policy(gpu_batch_size=2, cache=Split(0.5, 0.25, 0.25), compress_cache=Compression(4, 4,
                                                                                               cache_grouping=grouping))
    engine = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path, **CPU32)
    prompts = [list(range(5, 25)), list(range(30, 48))]
    made = []
    for steps in (12, 20):
        _Recorded.made = []
        engine.generate(prompts, SamplingParams(max_new_tokens=steps, ignore_eos=True))
        made.append(sum(b.allocations for b in _Recorded.made))
    assert made[0] > 0 and made[0] == made[1]


def test_kivi_with_a_group_dim_is_refused_before_loading(tiny_llama, tmp_path, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were opened before the cache's settings were checked")

    monkeypatch.setattr(engine_module, "open_weights", no_weights)
    policy = Policy(compress_cache=Compression(4, 4, group_dim=2, cache_grouping="kivi"))
    with pytest.raises(PolicyError, match="KIVI cache groups keys along the tokens .* leave the cache's group dim"):
        Engine.load(str(tiny_llama), policy, offload_dir=tmp_path, **CPU32)


def test_bad_groupings_are_refused():
    with pytest.raises(PolicyError, match="unknown cache grouping 'rows'"):
        Policy(compress_cache=Compression(4, 64, cache_grouping="rows"))
    with pytest.raises(PolicyError, match="compress_weight: cache_grouping 'kivi' is a KV cache setting"):
        Policy(compress_weight=Compression(4, 64, cache_grouping="kivi"))


def test_cli_flag_names_the_grouping_and_needs_a_compressed_cache(pinned_by_flags):
    """The policy fields the flags pin (the planner fills in the block; see tests/test_default_policy.py)."""
    assert Policy.from_dict(pinned_by_flags(["--compress-cache"])).compress_cache.cache_grouping \
        == DEFAULT_CACHE_GROUPING
    policy = Policy.from_dict(pinned_by_flags(["--compress-weight", "--compress-cache", "--cache-grouping",
                                              "per-token"]))
    assert policy.compress_cache.cache_grouping == "per-token" and policy.compress_weight.cache_grouping is None
    with pytest.raises(FlexGenError, match="--cache-grouping kivi .* add --compress-cache"):
        pinned_by_flags(["--compress-weight", "--cache-grouping", "kivi"])
