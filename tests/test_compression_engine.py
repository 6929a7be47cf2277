"""Compression and sparse attention in the engine change the numbers exactly as a simulated
quantization (or a hand-computed top-k attention) of the same tensors would, and no
placement, block shape, overlap setting or CPU delegation changes them further."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import fake_quantized_checkpoint

from flexgen_helm.compression import fake_quantize
from flexgen_helm.compression.stored import dense
from flexgen_helm.engine import Engine
from flexgen_helm.executor.attention import attend
from flexgen_helm.executor.kv_cache import KVCacheSlot, kv_nbytes
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.planner.budget import planned_bytes
from flexgen_helm.policy import Policy, Split
from flexgen_helm.policy.policy import Compression
from flexgen_helm.weights.compressed_store import CompressedStore

PROMPTS = [[5, 17, 3, 44, 9, 21, 8, 2, 60], [12, 7], [30, 31, 32, 33], [1, 2, 3], [40] * 11]
N_NEW = 5
CPU32 = dict(dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module", params=["tiny_opt", "tiny_llama"])
def model_path(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module", params=["tiny_opt", "tiny_llama", "tiny_gemma3"])
def cache_model_path(request):
    """The cache tests' models: also one whose sliding-window blocks keep rings."""
    return request.getfixturevalue(request.param)


def _generate(path, policy, offload_dir):
    engine = Engine.load(str(path), policy, offload_dir=offload_dir, **CPU32)
    run = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    return run.stats, [(r.completions[0].token_ids, r.completions[0].logprobs) for r in run.results]


def _assert_same(got, want, tol):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want):
        assert tokens == ref_tokens
        assert lps == pytest.approx(ref_lps, abs=tol)


def _max_logprob_gap(a, b) -> float:
    return max(abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb))


# ---- (a) weights ---------------------------------------------------------------------------

WEIGHT_CASES = {
    "4bit-g16-gpu": (Compression(4, 16), Policy(gpu_batch_size=2)),
    "4bit-g16-split-2x2": (Compression(4, 16),
                           Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0.3, 0.3, 0.4))),
    "3bit-g2-dim0-disk-no-overlap": (Compression(3, 2, group_dim=0),
                                     Policy(gpu_batch_size=3, weights=Split(0, 0, 1), overlap=False)),
    "4bit-g8-dim1-split": (Compression(4, 8, group_dim=1), Policy(gpu_batch_size=2, weights=Split(0.2, 0.5, 0.3))),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_compressed_weights_equal_fake_quantized_checkpoint(model_path, case, tmp_path):
    cfg, base = WEIGHT_CASES[case]
    policy = Policy.from_dict({**base.to_dict(), "compress_weight": cfg.__dict__})
    reference = Engine.load(str(fake_quantized_checkpoint(model_path, tmp_path / "fq", cfg)), base,
                            offload_dir=tmp_path / "off-ref", **CPU32)
    engine = Engine.load(str(model_path), policy, offload_dir=tmp_path / "off", **CPU32)
    for got, want in zip(engine.score(PROMPTS).results, reference.score(PROMPTS).results):
        assert got.logprobs[1:] == pytest.approx(want.logprobs[1:], abs=1e-4)
    _assert_same(_generate(model_path, policy, tmp_path / "off")[1],
                 _generate(tmp_path / "fq", base, tmp_path / "off-ref")[1], 1e-4)


def test_compressed_weights_placement_and_bytes(tiny_opt, tmp_path):
    cfg = Compression(4, 16)
    plain = Engine.load(str(tiny_opt), Policy(weights=Split(0.2, 0.5, 0.3)), offload_dir=tmp_path, **CPU32)
    policy = Policy(weights=Split(0.2, 0.5, 0.3), compress_weight=cfg)
    engine = Engine.load(str(tiny_opt), policy, offload_dir=tmp_path, **CPU32)
    rt = engine.runtime
    # cuts inside a tensor grouped along its rows fall on group boundaries (or its end)
    for home in rt.homes.values():
        if home.group_dim == 0:
            assert all(s.start % 16 == 0 and (s.end % 16 == 0 or s.end == home.spec.rows) for s in home.segments)
    report = engine.memory_report()["placement"]
    for tier, want in zip(("gpu", "cpu", "disk"), (0.2, 0.5, 0.3)):
        assert report["weight_fractions"][tier] == pytest.approx(want, abs=0.05)  # to within a group per tensor
    # every tier holds compressed bytes: the memory tiers' bookkeeping, the report, the budget...
    packed, full = report["weight_bytes"], plain.memory_report()["placement"]["weight_bytes"]
    assert sum(packed.values()) < 0.4 * sum(full.values())  # 4 bits + fp32 scale/min per 16, vs fp32
    assert rt.usage.current["gpu"] == packed["gpu"] and rt.usage.current["cpu"] == packed["cpu"]
    planned = planned_bytes(rt.config, Policy.from_dict({**policy.to_dict(), "cache": Split(1, 0, 0).__dict__}),
                            16, torch.float32)
    assert planned["cpu"] == packed["cpu"] and planned["disk"] == packed["disk"]
    # ...and the disk tier reads the compressed store, whose files hold those bytes
    assert isinstance(rt.store, CompressedStore)
    assert rt.store.store.total_bytes() < 0.4 * plain.runtime.store.total_bytes()
    manifest = rt.store.store.root / "manifest.json"
    written = manifest.stat().st_mtime_ns
    again = Engine.load(str(tiny_opt), policy, offload_dir=tmp_path, **CPU32)
    assert again.runtime.store.store.root == rt.store.store.root and manifest.stat().st_mtime_ns == written  # reused


# ---- (b) KV cache ------------------------------------------------------------------------

CACHE_CFG = Compression(4, 4, cache_grouping="per-token")  # head_dim 8 in the tiny models: two groups per row
KIVI_CFG = Compression(4, 4, cache_grouping="kivi")  # keys in groups of 4 tokens: several complete in 5 steps
GROUPINGS = pytest.mark.parametrize("cache_cfg", [CACHE_CFG, KIVI_CFG], ids=["per-token", "kivi"])
CACHE_POLICIES = {
    "gpu-1x1": Policy(),
    "cpu-2x2-delegated": Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 1, 0), cpu_cache_compute=True),
    "cpu-2x2": Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 1, 0)),
    "disk-4x2-no-overlap": Policy(gpu_batch_size=4, num_gpu_batches=2, cache=Split(0, 0, 1), overlap=False),
    "disk-delegated": Policy(gpu_batch_size=2, cache=Split(0, 0, 1), cpu_cache_compute=True),
    "split-2x3-delegated": Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0.25, 0.5, 0.25),
                                  cpu_cache_compute=True),
    "everything-split": Policy(gpu_batch_size=4, num_gpu_batches=2, weights=Split(0.2, 0.3, 0.5),
                               cache=Split(0.3, 0.3, 0.4), activations=Split(0.5, 0.25, 0.25), overlap=False),
}


def _with(policy: Policy, **changes) -> Policy:
    d = policy.to_dict()
    d.update({k: v.__dict__ if isinstance(v, (Compression, Split)) else v for k, v in changes.items()})
    return Policy.from_dict(d)


@GROUPINGS
def test_compressed_cache_is_policy_invariant(cache_model_path, cache_cfg, tmp_path):
    outs = {name: _generate(cache_model_path, _with(p, compress_cache=cache_cfg), tmp_path)[1]
            for name, p in CACHE_POLICIES.items()}
    ref = outs.pop("gpu-1x1")
    for got in outs.values():
        _assert_same(got, ref, 1e-5)
    dense = _generate(cache_model_path, Policy(), tmp_path)[1]
    assert _max_logprob_gap(ref, dense) > 1e-4  # the cache really is quantized


@pytest.mark.parametrize("cfg", [Compression(bits, group, cache_grouping="per-token")
                                 for bits, group in ((4, 4), (3, 64), (8, 8))]
                         + [Compression(4, 4, method="hqq", cache_grouping="per-token")])
def test_cache_reads_back_fake_quantized(cfg, tmp_path):
    units = {"gpu": 2, "cpu": 3, "disk": 2}
    usage = TierUsage()
    slot = KVCacheSlot(units, 12, 8, Devices(torch.device("cpu"), torch.float32), usage, tmp_path / "kv.bin",
                       pin=False, compression=cfg)
    assert usage.current["disk"] == kv_nbytes(12, 2, 8, torch.float32, cfg)
    assert usage.current["cpu"] == kv_nbytes(12, 3, 8, torch.float32, cfg)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, 7, 8, generator=g), torch.randn(10, 7, 8, generator=g) * 3 + 1
    slot.write(k[:6], v[:6], 0)  # a prefill, then one token at a time
    for t in range(6, 10):
        slot.write(k[t:t + 1], v[t:t + 1], t)
    for tier, (a, b) in slot.ranges.items():
        kr, vr = (dense(x) for x in slot.read(tier, 10))
        assert torch.equal(kr, fake_quantize(k[:, a:b], cfg, 2)) and torch.equal(vr, fake_quantize(v[:, a:b], cfg, 2))
    a, b = slot.ranges["disk"]
    assert torch.equal(dense(slot.read_disk_values([1, 4, 9])), fake_quantize(v[[1, 4, 9], a:b], cfg, 2))
    slot.close()
    assert all(n == 0 for n in usage.current.values())


def test_one_disk_row_reads_back_whose_scales_lie_off_a_floats_alignment(tmp_path):
    """One disk unit of head_dim 12 in 4-bit groups of 4: a row's codes take 6 bytes, so its
    scales start 6 bytes in; read alone (sparse attention keeping one row), it still views them."""
    cfg = Compression(4, 4, cache_grouping="per-token")
    slot = KVCacheSlot({"gpu": 1, "cpu": 0, "disk": 1}, 8, 12, Devices(torch.device("cpu"), torch.float32),
                       TierUsage(), tmp_path / "kv.bin", pin=False, compression=cfg)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(8, 2, 12, generator=g), torch.randn(8, 2, 12, generator=g)
    slot.write(k, v, 0)
    assert torch.equal(dense(slot.read_disk_values([5])), fake_quantize(v[[5], 1:], cfg, 2))
    slot.close()


# ---- (c) sparse attention ------------------------------------------------------------------

def test_sparse_attend_is_hand_computed_top_k():
    g = torch.Generator().manual_seed(1)
    u, r, t, d, f = 2, 2, 7, 4, 0.4
    q, k, v = torch.randn(u, r, 1, d, generator=g), torch.randn(u, t, d, generator=g), torch.randn(u, t, d, generator=g)
    valid = torch.ones(u, t, dtype=torch.bool)
    valid[1, :2] = False
    want = torch.empty(u, r, 1, d)
    kept_positions = set()
    for i in range(u):
        keep = math.ceil(f * int(valid[i].sum()))  # of the keys this unit may see: 3 of 7, 2 of 5
        for j in range(r):
            s = [float(q[i, j, 0] @ k[i, p]) / math.sqrt(d) if valid[i, p] else -math.inf for p in range(t)]
            top = sorted(range(t), key=lambda p: -s[p])[:keep]
            kept_positions |= set(top)
            w = torch.tensor([s[p] for p in top]).softmax(0)
            want[i, j, 0] = sum(w[n] * v[i, p] for n, p in enumerate(top))
    asked = []

    def rows(positions):
        asked.append(positions)
        return v[:, positions]

    torch.testing.assert_close(attend(q, k, v, valid, causal=False, keep_fraction=f), want)
    torch.testing.assert_close(attend(q, k, rows, valid, causal=False, keep_fraction=f), want)
    assert asked == [sorted(kept_positions)]  # V was asked only for the kept rows
    assert torch.equal(attend(q, k, v, valid, causal=False, keep_fraction=1.0), attend(q, k, v, valid, causal=False))


def test_sparsity_one_is_dense(tiny_llama, tmp_path):
    disk = Policy(gpu_batch_size=2, cache=Split(0, 0, 1))
    _assert_same(_generate(tiny_llama, _with(disk, attn_sparsity=1.0), tmp_path)[1],
                 _generate(tiny_llama, disk, tmp_path)[1], 0.0)


@pytest.mark.parametrize("compress_cache", [None, CACHE_CFG, KIVI_CFG], ids=["dense-cache", "per-token", "kivi"])
def test_sparse_attention_is_policy_invariant(cache_model_path, compress_cache, tmp_path):
    outs = {}
    for name in ("gpu-1x1", "cpu-2x2-delegated", "disk-4x2-no-overlap", "disk-delegated", "everything-split"):
        p = CACHE_POLICIES[name]
        stats, outs[name] = _generate(cache_model_path, _with(p, attn_sparsity=0.3, compress_cache=compress_cache),
                                      tmp_path)
        if p.cache.disk == 1.0 and not (compress_cache and compress_cache.kivi):  # V off disk row by row, after scoring
            # (a KIVI group's values lie beside its keys: they come with them)
            assert stats.timers["decode_read_sparse_values"] > 0
    ref = outs.pop("gpu-1x1")
    for got in outs.values():
        _assert_same(got, ref, 1e-5)
    dense = _generate(cache_model_path, _with(Policy(), compress_cache=compress_cache), tmp_path)[1]
    assert _max_logprob_gap(ref, dense) > 1e-4  # sparsity really drops keys


def test_sparse_disk_reads_only_kept_rows(tmp_path):
    slot = KVCacheSlot({"gpu": 0, "cpu": 0, "disk": 2}, 64, 64, Devices(torch.device("cpu"), torch.float32),
                       TierUsage(), tmp_path / "kv.bin", pin=False)
    v = torch.randn(64, 2, 64)
    slot.write(torch.zeros_like(v), v, 0)
    assert torch.equal(slot.read_disk_values([3, 40, 41]), v[[3, 40, 41]])
    row = 2 * 64 * 4  # bytes of one position: 8 rows share a 4 KiB page, so 3 and 40-41 are two runs
    assert slot.disk_bytes_read == 3 * row
    slot.disk_bytes_read = 0
    slot.read("disk", 64)
    assert slot.disk_bytes_read == 2 * 64 * row
    slot.close()


# ---- (d) scoring as decode: the accuracy evaluation's view of the cache --------------------

@pytest.mark.parametrize("compress_cache, sparsity",
                         [(CACHE_CFG, 1.0), (None, 0.3), (CACHE_CFG, 0.3), (KIVI_CFG, 1.0), (KIVI_CFG, 0.3)],
                         ids=["compressed", "sparse", "compressed-sparse", "kivi", "kivi-sparse"])
def test_score_as_decode_equals_generation(cache_model_path, compress_cache, sparsity, tmp_path):
    """Scoring a greedy continuation of one-token prompts with as_decode gives back the
    logprobs generation recorded for it: every token after the first came from a decode
    step, through the compressed (and sparse) cache; a plain score does not."""
    policy = _with(CACHE_POLICIES["cpu-2x2-delegated"], compress_cache=compress_cache, attn_sparsity=sparsity)
    engine = Engine.load(str(cache_model_path), policy, offload_dir=tmp_path, **CPU32)
    prompts = [[5], [12], [30], [40]]
    gen = engine.generate(prompts, SamplingParams(max_new_tokens=14, ignore_eos=True)).results
    texts = [p + r.completions[0].token_ids for p, r in zip(prompts, gen)]
    want = [r.completions[0].logprobs for r in gen]
    as_decode = [r.logprobs[1:] for r in engine.score(texts, as_decode=True).results]
    for got, ref in zip(as_decode, want):
        assert got == pytest.approx(ref, abs=1e-4)
    plain = [r.logprobs[1:] for r in engine.score(texts).results]
    # (5x the as_decode tolerance: tiny_opt's KIVI cache moves a log-prob by 9.9993e-4 at most here)
    assert max(abs(a - b) for x, y in zip(plain, want) for a, b in zip(x, y)) > 5e-4


def test_a_prefill_no_decode_follows_stores_no_cache(tiny_llama, tmp_path, monkeypatch):
    """A score, or a generation of one token, never reads the prompts' keys and values
    back: it does not store them (a 4-bit cache paid a quantization per layer for them);
    a generation of two tokens does."""
    policy = _with(CACHE_POLICIES["cpu-2x2-delegated"], compress_cache=CACHE_CFG)
    engine = Engine.load(str(tiny_llama), policy, offload_dir=tmp_path, **CPU32)
    writes = []
    real = KVCacheSlot.write
    monkeypatch.setattr(KVCacheSlot, "write", lambda self, *a, **k: writes.append(1) or real(self, *a, **k))
    one = engine.generate(PROMPTS, SamplingParams(max_new_tokens=1, ignore_eos=True)).results
    scored = engine.score([p + r.completions[0].token_ids for p, r in zip(PROMPTS, one)]).results
    assert not writes
    for r, s in zip(one, scored):
        assert r.completions[0].logprobs == pytest.approx(s.logprobs[-1:], abs=1e-4)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert writes


@GROUPINGS
def test_score_as_decode_is_policy_invariant_with_padding(model_path, cache_cfg, tmp_path):
    """Prompts of different lengths share left-padded batches: padding changes nothing (a
    KIVI cache's groups count from each prompt's first token)."""
    texts = PROMPTS + [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    scores = {}
    for name in ("gpu-1x1", "cpu-2x2-delegated", "disk-4x2-no-overlap"):
        policy = _with(CACHE_POLICIES[name], compress_cache=cache_cfg, attn_sparsity=0.3)
        engine = Engine.load(str(model_path), policy, offload_dir=tmp_path, **CPU32)
        scores[name] = [r.logprobs[1:] for r in engine.score(texts, as_decode=True).results]
    alone_policy = _with(Policy(), compress_cache=cache_cfg, attn_sparsity=0.3)
    alone = [Engine.load(str(model_path), alone_policy, offload_dir=tmp_path, **CPU32).score([t], as_decode=True)
             .results[0].logprobs[1:] for t in texts[:2]]
    for got in list(scores.values()) + [alone + scores["gpu-1x1"][2:]]:
        for a, b in zip(got, scores["gpu-1x1"]):
            assert a == pytest.approx(b, abs=1e-5)
