"""A decode step multiplies each transformer block's weights once for the whole block, and the
head's once for up to 64 rows: the live rows of every GPU batch go through the block's linear
layers together, attention stays batch by batch over each batch's own cache, and the tokens
are those of each prompt alone (float32)."""

from __future__ import annotations

import threading

import pytest

from flexgen_helm.engine import Engine
from flexgen_helm.executor import cache_buffers
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.executor.schedule import BlockSchedule
from flexgen_helm.models import FAMILIES
from flexgen_helm.policy import Policy, Split

# pairs of one length: GPU batches of 2 (plan_blocks), of different lengths
PROMPTS = [[5, 17, 3, 44, 9], [1, 2, 3, 4, 5], [12, 7, 8], [30, 31, 32], [40] * 6, [8, 9, 10, 11, 12, 13]]
NEW = 4


@pytest.mark.parametrize("fixture,family,load_bytes", [("tiny_opt", "opt", None), ("tiny_llama", "llama", None),
                                                       ("tiny_llama", "llama", 1)])
def test_a_decode_step_multiplies_a_blocks_weights_once(fixture, family, load_bytes, request, tmp_path,
                                                        monkeypatch):
    """load_bytes: what one cache load may hold (1: a load per GPU batch; default: all three)."""
    if load_bytes is not None:
        monkeypatch.setattr(cache_buffers, "WHOLE_LAYER_LOAD_BYTES", load_bytes)
        monkeypatch.setattr(cache_buffers, "GROUP_LOAD_BYTES", load_bytes)
    path = str(request.getfixturevalue(fixture))
    alone = Engine.load(path, Policy(), dtype="float32", device="cpu", offload_dir=tmp_path / "alone", progress=False)
    want = alone.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).results

    module = FAMILIES[family]
    rows_seen = []
    qkv = module.qkv

    def counting_qkv(cfg, w, h, at, block):
        rows_seen.append((h.shape[0], h.shape[1]))
        return qkv(cfg, w, h, at, block)

    monkeypatch.setattr(module, "qkv", counting_qkv)
    head_rows, head = [], module.head

    def counting_head(cfg, w, h):
        head_rows.append(h.shape[0])
        return head(cfg, w, h)

    monkeypatch.setattr(module, "head", counting_head)
    loads = []
    load_group = BlockSchedule._load_group_cache

    def counting_loads(self, layer, ks):
        loads.append(len(ks))
        return load_group(self, layer, ks)

    monkeypatch.setattr(BlockSchedule, "_load_group_cache", counting_loads)
    split = Engine.load(path, Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0.3, 0.4, 0.3)),
                        dtype="float32", device="cpu", offload_dir=tmp_path / "split", progress=False)
    got = split.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).results

    for g, w in zip(got, want):
        assert g.completions[0].token_ids == w.completions[0].token_ids
        assert g.completions[0].logprobs == pytest.approx(w.completions[0].logprobs, abs=1e-4)
    decode = [r for r in rows_seen if r[1] == 1]
    prefill = [r for r in rows_seen if r[1] > 1]
    assert prefill and all(rows == 2 for rows, _ in prefill)  # prefill: GPU batch by GPU batch (3 a layer)
    assert all(rows == 6 for rows, _ in decode)  # decode: the block's 6 rows at once
    assert len(decode) == len(prefill) // 3 * (NEW - 1)  # once a layer and step
    assert set(loads) == {1 if load_bytes == 1 else 3}  # the three batches' caches: a load each, or one
    # the head: a call per GPU batch in the prefill, one for the block's 6 rows a decode step
    assert head_rows == [2, 2, 2] + [6] * (NEW - 1)


def test_a_decode_step_reads_the_next_blocks_cache_while_this_one_attends(tiny_llama, tmp_path, monkeypatch):
    """The cache on disk: block 1's cache of every GPU batch is read, the batches' reads in
    flight together, before block 0 attends (a read batch after batch waited its turn each)."""
    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0, 0, 1)),
                         dtype="float32", device="cpu", offload_dir=tmp_path, progress=False)
    together = threading.Barrier(3, timeout=10)  # breaks unless the 3 batches' reads run at once
    block1_read = threading.Event()
    read, attend = BlockSchedule._read_cache, BlockSchedule._attend

    def read_cache(self, layer, k):
        together.wait()
        out = read(self, layer, k)
        if layer.index == 1:
            block1_read.set()
        return out

    def attend_(self, index, k, q, key, value, cache, prefill, sinks=None):
        if index == 0 and k == 0 and not prefill:
            assert block1_read.wait(10), "block 0 attended before block 1's cache was read"
            block1_read.clear()
        return attend(self, index, k, q, key, value, cache, prefill, sinks)

    monkeypatch.setattr(BlockSchedule, "_read_cache", read_cache)
    monkeypatch.setattr(BlockSchedule, "_attend", attend_)
    run = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert all(len(r.completions[0].token_ids) == NEW for r in run.results)


def test_a_decode_steps_head_merges_gpu_batches_up_to_its_rows():
    """Consecutive GPU batches while their rows sum to at most 64, a bigger batch alone; the
    memory planned for a call bounds every call, and the cost model counts the calls made."""
    from flexgen_helm.executor.working_set import decode_head_rows, decode_head_work, head_calls

    assert head_calls([4, 4, 56, 1, 70, 10]) == [[0, 1, 2], [3], [4], [5]]
    assert head_calls([]) == []
    for gbs, nb in ((4, 32), (4, 8), (5, 13), (3, 22), (48, 2), (128, 4), (7, 1)):
        calls = head_calls([gbs] * nb)
        assert max(gbs * len(c) for c in calls) <= decode_head_rows(gbs, nb)
        rows, n = decode_head_work(gbs, nb)
        assert n == len(calls) and rows * n - gbs * nb < n  # every row counted, rounded up per call
    assert head_calls([5, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])[0] == list(range(13))  # 64 rows, thinned
    assert decode_head_rows(5, 13) == 64


def test_a_layers_cache_is_one_load_where_it_fits_else_parts_of_it():
    """cache_buffers.load_group: the memory the loads hold (on a CPU, two loads as read and one
    set of unpacked buffers; a GPU, one as read and two sets); a whole layer in one load up to
    WHOLE_LAYER_LOAD_BYTES, else as many batches as GROUP_LOAD_BYTES holds, at least one."""
    from flexgen_helm.executor.cache_buffers import GROUP_LOAD_BYTES, WHOLE_LAYER_LOAD_BYTES, load_group

    mib = 1 << 20
    # OLMoE's block of 32 read in place on a CPU: two batches of ~48 MB, nothing unpacked
    assert load_group(48 * mib, 0, 2, on_lane=False) == (2, 192 * mib)
    # unpacked to float32 (twice the bytes): the layer is past the whole-layer cap, a batch a load
    assert load_group(48 * mib, 96 * mib, 2, on_lane=False) == (1, 192 * mib)
    # 32 batches of 5 MiB on a GPU: 15 MiB each; parts of 8 batches
    n, held = load_group(5 * mib, 5 * mib, 32, on_lane=True)
    assert (n, held) == (8, 120 * mib) and held <= GROUP_LOAD_BYTES < 32 * 15 * mib
    # one batch past every cap still loads; nothing moved holds nothing
    assert load_group(WHOLE_LAYER_LOAD_BYTES, 0, 3, on_lane=False) == (1, 2 * WHOLE_LAYER_LOAD_BYTES)
    assert load_group(0, 0, 4, on_lane=False) == (4, 0)
