"""A block computes the prompt prefix its sequences share once (executor/shared_prefix.py):
with sharing on and off, every policy gives the same tokens and (float32) log-probs, scoring
gives the same log-probs, and the prefill runs through the layers only the tokens the stats
say it computed: the prefix once, then each GPU batch's columns after it."""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import caches_holding_a_prefix, save_tiny

from flexgen_helm.engine import Engine
from flexgen_helm.executor.generation import plan_blocks
from flexgen_helm.executor.kv_cache import kv_nbytes
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.executor.shared_prefix import MIN_SHARED_TOKENS, common_prefix_len, shared_prefix_len
from flexgen_helm.policy import Compression, Policy, Split

_rng = random.Random(0)
# a few-shot run: the same instructions and examples, then each instance's own question
# (1 to 7 tokens: the GPU batches' windows differ, and shorter rows recompute prefix tokens)
PREFIX = [_rng.randrange(3, 290) for _ in range(3 * MIN_SHARED_TOKENS)]
PROMPTS = [PREFIX + [_rng.randrange(3, 290) for _ in range(_rng.randrange(1, 8))] for _ in range(10)]
N_NEW = 5

POLICIES = {
    "all-in-one-batch": Policy(gpu_batch_size=16),
    "blocks-4x2": Policy(gpu_batch_size=4, num_gpu_batches=2),
    "weights-disk-cache-split-delegated": Policy(gpu_batch_size=2, num_gpu_batches=3, weights=Split(0, 0.5, 0.5),
                                                 cache=Split(0.25, 0.5, 0.25), cpu_cache_compute=True),
    "everything-split-no-overlap": Policy(gpu_batch_size=4, num_gpu_batches=2, weights=Split(0.2, 0.3, 0.5),
                                          cache=Split(0.3, 0.3, 0.4), activations=Split(0.5, 0.25, 0.25),
                                          overlap=False, cpu_cache_compute=True),
    "kivi-cache-sparse": Policy(gpu_batch_size=4, num_gpu_batches=2, cache=Split(0, 0.5, 0.5), attn_sparsity=0.5,
                                compress_cache=Compression(4, 8, cache_grouping="kivi")),
    "per-token-cache-compressed-weights": Policy(gpu_batch_size=4, num_gpu_batches=2,
                                                 compress_cache=Compression(4, 8, cache_grouping="per-token"),
                                                 compress_weight=Compression(4, 16)),
    # KIVI's groups of 20: the prefix's first 40 tokens are every row's first two groups, held
    # once; its last 8 fill up a group with each row's own tokens
    "kivi-cache": Policy(gpu_batch_size=4, num_gpu_batches=2, compress_cache=Compression(4, 20, cache_grouping="kivi")),
    "per-token-cache-8bit": Policy(gpu_batch_size=4, num_gpu_batches=2,
                                   compress_cache=Compression(8, 4, cache_grouping="per-token")),
    # the same values held dense (keep_dense_cache): the prefix's one copy holds them rounded
    "per-token-cache-8bit-held-dense": Policy(gpu_batch_size=4, num_gpu_batches=2, keep_dense_cache=True,
                                              compress_cache=Compression(8, 4, cache_grouping="per-token")),
    "kivi-cache-held-dense": Policy(gpu_batch_size=4, num_gpu_batches=2, keep_dense_cache=True,
                                    compress_cache=Compression(4, 20, cache_grouping="kivi")),
    "sparse": Policy(gpu_batch_size=4, num_gpu_batches=2, attn_sparsity=0.3),
    # (sparse attention reads the disk tier's values apart, only those of the keys it keeps)
    "compressed-cache-split-delegated": Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0.25, 0.5, 0.25),
                                               cpu_cache_compute=True, attn_sparsity=0.5,
                                               compress_cache=Compression(4, 4, cache_grouping="per-token")),
    "kivi-cache-split-delegated-no-overlap": Policy(gpu_batch_size=2, num_gpu_batches=3, cache=Split(0.3, 0.3, 0.4),
                                                    cpu_cache_compute=True, overlap=False,
                                                    compress_cache=Compression(4, 16, cache_grouping="kivi")),
}


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory):
    """A mixture of experts with a shared expert: the prefix's tokens route on their own."""
    return save_tiny("qwen2_moe", tmp_path_factory.mktemp("tiny-qwen2-moe"))


@pytest.fixture(scope="module", params=["tiny_opt", "tiny_llama", "tiny_gemma3", "tiny_qwen2_moe"])
def model_path(request):
    return request.getfixturevalue(request.param)


def _engine(path, policy, tmp_path, sharing: bool) -> Engine:
    return Engine.load(str(path), dataclasses.replace(policy, prefix_sharing=sharing), dtype="float32", device="cpu",
                       offload_dir=tmp_path, progress=False)


@pytest.mark.parametrize("name", list(POLICIES))
def test_same_tokens_and_logprobs_with_and_without_sharing(model_path, name, tmp_path):
    _check_same_with_and_without_sharing(model_path, POLICIES[name], tmp_path)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """Attention sinks: applied once to each decode step's softmax over the prefix's one copy
    and the rest merged; sliding-window blocks (window 4) beside global ones."""
    return save_tiny("gpt_oss", tmp_path_factory.mktemp("tiny-gpt-oss"))


@pytest.fixture
def one_thread():
    """Tiny matrices: torch's second thread only spins (tests/test_model_families.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# gpt-oss refuses sparse attention (sinks): every dense policy, plain and compressed caches
@pytest.mark.parametrize("name", [n for n, p in POLICIES.items() if p.attn_sparsity == 1.0])
def test_gpt_oss_same_tokens_and_logprobs_with_and_without_sharing(tiny_gpt_oss, name, tmp_path, one_thread):
    _check_same_with_and_without_sharing(tiny_gpt_oss, POLICIES[name], tmp_path)


def _check_same_with_and_without_sharing(model_path, policy: Policy, tmp_path) -> None:
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, top_logprobs=2)
    runs = [_engine(model_path, policy, tmp_path, sharing).generate(PROMPTS, params) for sharing in (0, 1)]
    (plain, shared) = runs
    assert plain.stats.computed_prompt_tokens == plain.stats.padded_prompt_tokens
    assert shared.stats.computed_prompt_tokens < plain.stats.computed_prompt_tokens
    for a, b in zip(plain.results, shared.results):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == pytest.approx(b.completions[0].logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def tiny_llama_long(tmp_path_factory):
    """Room for a prefix long against each row's own tokens (100 against 1-7)."""
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama-long"), max_position_embeddings=256)


@pytest.mark.parametrize("name", ["all-in-one-batch", "blocks-4x2", "everything-split-no-overlap", "kivi-cache",
                                  "per-token-cache-8bit-held-dense"])
def test_a_long_prefix_read_as_one_copy_in_the_prefill_gives_the_same(tiny_llama_long, name, tmp_path, monkeypatch):
    """Prompts whose shared prefix is long against their own tokens: each GPU batch's prefill
    window reads the prefix positions every row holds as one copy (and, over a dense slot that
    holds them out, leaves its joined columns unmade); the same tokens and log-probs as
    without sharing."""
    import flexgen_helm.executor.shared_prefix as shared_prefix

    calls = []
    read_as_one = shared_prefix.attend_window_past_shared_prefix
    monkeypatch.setattr(shared_prefix, "attend_window_past_shared_prefix",
                        lambda *a, **k: calls.append(1) or read_as_one(*a, **k))
    rng = random.Random(1)
    prefix = [rng.randrange(3, 290) for _ in range(100)]
    prompts = [prefix + [rng.randrange(3, 290) for _ in range(rng.randrange(1, 8))] for _ in range(10)]
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, top_logprobs=2)
    policy = POLICIES[name]
    plain, shared = (_engine(tiny_llama_long, policy, tmp_path, sharing).generate(prompts, params)
                     for sharing in (False, True))
    assert calls and shared.stats.computed_prompt_tokens < plain.stats.computed_prompt_tokens
    for a, b in zip(plain.results, shared.results):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == pytest.approx(b.completions[0].logprobs, abs=1e-4)


@pytest.mark.parametrize("name", ["all-in-one-batch", "compressed-cache-split-delegated",
                                  "kivi-cache-split-delegated-no-overlap", "kivi-cache-held-dense"])
def test_sequences_that_finish_early_leave_a_block_that_holds_its_prefix_once(tiny_llama, name, tmp_path):
    """A finished sequence's units leave the steps (a tier's computed units are then some of
    its own, not a run of whole GPU batches): the others still attend to the prefix's one
    copy, and give what they give without sharing."""
    plain = _engine(tiny_llama, POLICIES[name], tmp_path, False).generate(
        PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    limits = [1 + i % N_NEW for i in range(len(PROMPTS))]
    shared = _engine(tiny_llama, POLICIES[name], tmp_path, True).generate(
        PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in limits])
    assert shared.stats.padded_generated_tokens == sum(limits)
    for a, b, n in zip(plain.results, shared.results, limits):
        assert b.completions[0].token_ids == a.completions[0].token_ids[:n]
        assert b.completions[0].logprobs == pytest.approx(a.completions[0].logprobs[:n], abs=1e-4)


@pytest.mark.parametrize("scored_from", ["every-token", "last-tokens", "mixed"])
def test_scoring_is_the_same_with_and_without_sharing(tiny_llama, tmp_path, scored_from):
    """Scored positions inside the shared prefix (HELM's echo scores every token) are scored
    once for the block and taken by every row at its own offset."""
    firsts = {"every-token": [1] * len(PROMPTS), "last-tokens": [len(p) - 2 for p in PROMPTS],
              "mixed": [len(PREFIX) - 4, 1, *[len(p) - 1 for p in PROMPTS[2:]]]}[scored_from]
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2)
    plain, shared = (_engine(tiny_llama, policy, tmp_path, sharing).score(PROMPTS, top_logprobs=2, first_scored=firsts)
                     for sharing in (0, 1))
    assert shared.stats.computed_prompt_tokens < plain.stats.computed_prompt_tokens
    for a, b in zip(plain.results, shared.results):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, nan_ok=True)
        assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
        for x, y in zip(a.top_logprobs, b.top_logprobs):
            assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)


def test_n_samples_of_one_prompt_share_all_but_its_last_token(tiny_llama, tmp_path):
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0.9, seed=7, num_completions=4, ignore_eos=True)
    policy = Policy(gpu_batch_size=4)
    plain, shared = (_engine(tiny_llama, policy, tmp_path, sharing).generate([prompt], params) for sharing in (0, 1))
    assert [c.token_ids for c in plain.results[0].completions] == [c.token_ids for c in shared.results[0].completions]
    assert shared.stats.computed_prompt_tokens == (len(prompt) - 1) + 4 * 1


def test_the_prefill_computes_what_the_stats_say(tiny_llama, tmp_path, monkeypatch):
    """Every token that reaches a block's attention at prefill is counted, and no more."""
    from flexgen_helm.models import llama

    seen = []
    real = llama.finish_block
    monkeypatch.setattr(llama, "finish_block", lambda cfg, w, h, a: seen.append(h.shape[0] * h.shape[1]) or
                        real(cfg, w, h, a))
    engine = _engine(tiny_llama, Policy(gpu_batch_size=4, num_gpu_batches=2), tmp_path, True)
    run = engine.generate(PROMPTS, SamplingParams(max_new_tokens=1, ignore_eos=True))
    blocks = engine.config.num_layers
    assert sum(seen) == blocks * run.stats.computed_prompt_tokens
    padded_suffixes = run.stats.computed_prompt_tokens - len(PREFIX) * run.stats.blocks
    assert padded_suffixes <= sum(len(p) - len(PREFIX) for p in PROMPTS) + 6 * len(PROMPTS)  # padding: < 7 each


def test_prompts_that_share_nothing_run_as_before(tiny_llama, tmp_path):
    prompts = [[_rng.randrange(3, 290) for _ in range(40)] for _ in range(6)]
    run = _engine(tiny_llama, Policy(gpu_batch_size=8), tmp_path, True).generate(
        prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert run.stats.computed_prompt_tokens == run.stats.padded_prompt_tokens


def test_how_much_is_shared():
    long = list(range(100))
    assert common_prefix_len([long, long[:50] + [7], long[:60]]) == 50
    # every prompt keeps a token of its own (last_shared), and a short common prefix is not worth it
    assert shared_prefix_len([[long[:80], long[:80] + [1]]], [79, 80]) == 79
    assert shared_prefix_len([[long[:80]], [long[:40] + [9] * 40]], [79, 79]) == 40
    assert shared_prefix_len([[long[:20] + [1] * 200, long[:20] + [2] * 200]], [219, 219]) == 0  # saves < 10%
    assert shared_prefix_len([[long[:MIN_SHARED_TOKENS - 1] + [1], long[:MIN_SHARED_TOKENS - 1] + [2]]],
                             [MIN_SHARED_TOKENS] * 2) == 0
    assert shared_prefix_len([[long]], [99]) == 0  # one sequence: nothing to share with


def test_a_stage_decides_the_prefix_and_counts_the_tokens_one_process_does(tiny_llama, tmp_path):
    """Every pipeline stage holds the block's prompts and policy: a stage without the
    embedding or the head decides the same shared prefix and counts the same tokens."""
    from flexgen_helm.executor.generation import BlockDriver
    from flexgen_helm.executor.sampling import RunStats

    rt = _engine(tiny_llama, Policy(), tmp_path, True).runtime
    batches, last = [PROMPTS[:4], PROMPTS[4:8], PROMPTS[8:]], [len(p) - 1 for p in PROMPTS]
    whole = BlockDriver(rt, Policy(), tmp_path, RunStats())
    stage = BlockDriver(SimpleNamespace(layers=rt.layers[1:-1], devices=rt.devices, config=rt.config), Policy(),
                        tmp_path, RunStats())
    assert whole.start_block(batches, last).length == stage.start_block(batches, last, 2).length == len(PREFIX)
    assert whole.stats == stage.stats
    assert whole.stats.computed_prompt_tokens < whole.stats.padded_prompt_tokens


def test_micro_batches_share_one_run_of_the_prefix_and_a_later_stage_starts_from_hidden_states(
        tiny_llama, tmp_path, monkeypatch):
    """A pipeline stage's block runs as micro-batches, a schedule each: the first to reach a
    layer runs the prefix through it, the others get the same keys and values. A stage after
    the embedding, started from the hidden states the stage before hands on, makes the keys
    and values the whole model makes."""
    import torch

    from flexgen_helm.executor.shared_prefix import SharedPrefix
    from flexgen_helm.models import llama

    rt = _engine(tiny_llama, Policy(), tmp_path, True).runtime
    family, cfg, layers = rt.family, rt.config, rt.layers
    weights = [rt.load_layer(layer) for layer in layers]
    ids = torch.tensor(PREFIX)[None]
    at = family.step_constants(family.run_constants(cfg, len(PREFIX), torch.device("cpu"), torch.float32),
                               torch.arange(len(PREFIX))[None])
    whole = SharedPrefix(ids)
    alone = [whole.run_layer(family, cfg, layer, w, at) for layer, w in zip(layers, weights)]

    runs = []
    real = llama.finish_block
    monkeypatch.setattr(llama, "finish_block", lambda cfg, w, h, a: runs.append(h.shape[1]) or real(cfg, w, h, a))
    cut = 2  # stage 0: the embedding and block 0; stage 1: the other blocks and the head
    first, later = SharedPrefix(ids, micro_batches=3), SharedPrefix(ids, micro_batches=3)
    for _ in range(3):
        for layer, w in zip(layers[:cut], weights[:cut]):
            first.run_layer(family, cfg, layer, w, at)
    with pytest.raises(ValueError, match="start_from"):
        SharedPrefix(ids).run_layer(family, cfg, layers[cut], weights[cut], at)
    later.start_from(first.hidden)
    made = [[later.run_layer(family, cfg, layer, w, at) for layer, w in zip(layers[cut:], weights[cut:])]
            for _ in range(3)]
    assert runs == [len(PREFIX)] * cfg.num_layers  # each block once, for all three micro-batches
    assert all(a is b is c for a, b, c in zip(*made))  # the same layer results, not recomputed
    for m, want in zip(made[0], alone[cut:]):
        assert (m is None) == (want is None)
        if want is not None:
            assert torch.allclose(m.keys, want.keys, atol=1e-6) and torch.allclose(m.values, want.values, atol=1e-6)


def test_decode_steps_attend_to_the_shared_prefix_once_for_all_sequences(tiny_llama, tmp_path, monkeypatch):
    from flexgen_helm.executor import schedule

    calls = []
    real = schedule.attend_past_shared_prefix
    monkeypatch.setattr(schedule, "attend_past_shared_prefix",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    engine = _engine(tiny_llama, Policy(gpu_batch_size=16), tmp_path, True)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, ignore_eos=True))
    # every layer of the two decode steps after the prefill's token, for every sequence (in
    # the GPU batches the block's lengths cut it into)
    assert sum(shape[0] for shape in calls) == engine.config.num_layers * 2 * len(PROMPTS) * engine.config.num_kv_heads


def test_bf16_decode_over_the_shared_prefix_stays_within_bf16_rounding(tiny_llama, tmp_path, monkeypatch):
    """A bfloat16 model's decode steps read the prefix in its bf16 layout (on a CPU with bf16
    arithmetic): their logprobs stay within bf16's rounding of the run without sharing."""
    from flexgen_helm.executor import attention
    from flexgen_helm.memory.devices import cpu_has_bf16_arithmetic

    calls = []
    real = attention._bf16_prefix_part
    monkeypatch.setattr(attention, "_bf16_prefix_part", lambda *a: calls.append(1) or real(*a))
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    runs = [Engine.load(str(tiny_llama), Policy(gpu_batch_size=16, prefix_sharing=sharing), dtype="bfloat16",
                        device="cpu", offload_dir=tmp_path, progress=False).generate(PROMPTS, params)
            for sharing in (False, True)]
    assert bool(calls) == cpu_has_bf16_arithmetic()
    for a, b in zip(*(run.results for run in runs)):
        n = len(a.completions[0].token_ids)
        first_differs = next((i for i in range(n) if a.completions[0].token_ids[i] != b.completions[0].token_ids[i]), n)
        same = slice(0, first_differs + 1 if first_differs < n else n)  # up to where greedy choices part
        assert a.completions[0].logprobs[same] == pytest.approx(b.completions[0].logprobs[same], abs=0.1)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_shared_prefix_attention_is_attention(softcap):
    """One matmul per key-value head over the prefix, the rest per unit, merged: what plain
    decode attention over each whole cache computes."""

    from flexgen_helm.executor.attention import DecodePrefix, attend, attend_past_shared_prefix
    from flexgen_helm.executor.kv_cache import keys_outside_prefix

    q, k, v, valid, prefix_k, prefix_v, starts = caches_holding_a_prefix(1)
    want = attend(q, k, v, valid, causal=False, softcap=softcap)
    kvh, n = prefix_k.shape[0], prefix_k.shape[1]
    own = keys_outside_prefix(valid, starts[torch.arange(q.shape[0]) // kvh], n)
    got = attend_past_shared_prefix(q, k, v, own, DecodePrefix(prefix_k, prefix_v), softcap=softcap)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("slices", ["one", "of two sequences", "of five rows"])
def test_a_window_prefill_attends_to_the_prefix_as_over_each_rows_columns(softcap, with_sinks, slices, monkeypatch):
    """A GPU batch's window queries (rows padded differently, so each row's columns hold the
    prefix from its own offset and recompute its last tokens) over the one copy of the prefix
    that every row's columns hold, and the rest per row: what causal attention over each
    row's joined columns computes; also where the prefix part takes the queries a slice at a
    time (attention.WINDOW_MAX_SCORES): slices of whole sequences, or of one sequence's rows."""
    from flexgen_helm.executor import attention
    from flexgen_helm.executor.attention import attend
    from flexgen_helm.executor.shared_prefix import PrefixLayer

    torch.manual_seed(0)
    kvh, width, d, r, s = 2, MIN_SHARED_TOKENS + 9, 8, 3, 7
    pad = torch.tensor([0, 2, 5])
    u = len(pad) * kvh
    prefix = PrefixLayer(torch.randn(kvh, width, d), torch.randn(kvh, width, d))
    q, own_k, own_v = torch.randn(u, r, s, d), torch.randn(u, s, d), torch.randn(u, s, d)
    keys, values = prefix.with_context(pad, own_k, own_v)
    valid = torch.arange(width + s)[None, :] >= pad.repeat_interleave(kvh)[:, None]  # a row's padding first
    sinks = torch.randn(u, r) if with_sinks else None
    want = attend(q, keys, values, valid, causal=True, softcap=softcap, sinks=sinks)
    split = prefix.window_split(pad, q.device)
    cap = {"one": attention.WINDOW_MAX_SCORES, "of two sequences": 2 * kvh * r * s * split,
           "of five rows": 5 * kvh * split}[slices]
    monkeypatch.setattr(attention, "WINDOW_MAX_SCORES", cap)
    got = prefix.attend_window(q, keys, values, pad, split, valid, softcap, sinks)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("offset", [0.0, 3.0])
@pytest.mark.parametrize("row_sums", ["in the product", "the fused kernel"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_bf16_window_prefill_stays_within_bf16_rounding_of_the_float32_attention(offset, row_sums, with_sinks,
                                                                                    monkeypatch):
    """In bfloat16 (on a CPU with bf16 arithmetic, the window's own part's products in bf16, the
    keys' shared component taken out first): as far from the float32 attention as torch's fused
    kernel over the joined columns is, give or take rounding, keys with a large shared part too;
    with the prefix part's weight sums out of its product with the values (a column of ones:
    no slice falls back to the peak-out way where its scores stay small), and on torch's fused
    kernel (attention.FUSED_PREFIX_PART); and with attention sinks (gpt-oss: one more column of
    the own part's softmax)."""
    from flexgen_helm.executor import attention
    from flexgen_helm.executor.attention import attend
    from flexgen_helm.executor.shared_prefix import PrefixLayer

    attention.set_fused_prefix_part("cpu", {"window"} if row_sums == "the fused kernel" else ())
    peaks_out = []
    real = attention._shifted_bf16_prefix_part
    monkeypatch.setattr(attention, "_shifted_bf16_prefix_part", lambda *a: peaks_out.append(1) or real(*a))

    torch.manual_seed(0)
    kvh, width, d, r, s = 3, 200, 64, 3, 30
    pad = torch.tensor([0, 4, 9, 2])
    u = len(pad) * kvh
    prefix_k, prefix_v = torch.randn(kvh, width, d) + offset, torch.randn(kvh, width, d)
    q, own_k, own_v = torch.randn(u, r, s, d), torch.randn(u, s, d) + offset, torch.randn(u, s, d)
    valid = torch.arange(width + s)[None, :] >= pad.repeat_interleave(kvh)[:, None]
    sinks = 2 * torch.randn(u, r) if with_sinks else None
    keys, values = PrefixLayer(prefix_k, prefix_v).with_context(pad, own_k, own_v)
    want = attend(q, keys, values, valid, causal=True, sinks=sinks)
    prefix = PrefixLayer(prefix_k.bfloat16(), prefix_v.bfloat16())
    keys, values = prefix.with_context(pad, own_k.bfloat16(), own_v.bfloat16())
    got = prefix.attend_window(q.bfloat16(), keys, values, pad, prefix.window_split(pad, q.device), valid, sinks=sinks)
    fused = attend(q.bfloat16(), keys, values, valid, causal=True, sinks=sinks)
    err, fused_err = ((x.float() - want).abs().max().item() for x in (got, fused))
    assert err <= max(2 * fused_err, 5e-3), (err, fused_err)
    assert not (offset == 0.0 and peaks_out)


def test_a_prefix_parts_row_sums_are_the_same_in_any_slicing(monkeypatch):
    """A decode step's bf16 prefix part sums its weights in float32 a slice of rows at a time
    where they are many (attention.ROW_SUM_ELEMENTS): each row's sum is the same bits as summed
    whole."""
    from flexgen_helm.executor import attention

    weights = torch.rand(3, 50, 200).bfloat16()
    whole = attention._row_sums(weights)
    monkeypatch.setattr(attention, "ROW_SUM_ELEMENTS", 7 * 200)  # slices of 7 rows, across the heads' rows
    assert torch.equal(attention._row_sums(weights), whole)
    assert torch.equal(whole, weights.float().sum(-1, keepdim=True))


def test_a_bf16_windows_prefix_is_laid_out_for_its_own_use_and_read_right_in_the_other_layout():
    """A prefill window's copy of the prefix (PrefixLayer.attend_window's) is laid out for the
    windows' path (FUSED_PREFIX_PART's "window"), whatever the decode steps take; one made by
    position for the kernel and then read by our products (the setting changed since, as a
    profile's timing changes it) gives the same bits as one made for our products."""
    from flexgen_helm.executor import attention
    from flexgen_helm.executor.shared_prefix import PrefixLayer

    torch.manual_seed(1)
    kvh, width, d, r, s = 3, 200, 64, 3, 30
    pad = torch.tensor([0, 4, 9, 2])
    u = len(pad) * kvh
    prefix_k, prefix_v = (torch.randn(kvh, width, d).bfloat16() for _ in range(2))
    q, own_k, own_v = torch.randn(u, r, s, d).bfloat16(), *(torch.randn(u, s, d).bfloat16() for _ in range(2))
    valid = torch.arange(width + s)[None, :] >= pad.repeat_interleave(kvh)[:, None]

    def window(layer: PrefixLayer) -> torch.Tensor:
        keys, values = layer.with_context(pad, own_k, own_v)
        return layer.attend_window(q, keys, values, pad, layer.window_split(pad, q.device), valid)

    layouts = {}
    for uses in ((), {"decode"}, {"window"}, {"decode", "window"}):
        attention.set_fused_prefix_part("cpu", uses)
        layer = PrefixLayer(prefix_k, prefix_v)
        window(layer)
        heads = list(layer._heads.values())
        if heads[0].key_mean is None:
            pytest.skip("this CPU emulates bf16 matmuls: no bf16 layout is made")
        layouts[frozenset(uses)] = heads[0].by_position, layer
    assert {uses: by_position for uses, (by_position, _) in layouts.items()} == {
        frozenset(): False, frozenset({"decode"}): False, frozenset({"window"}): True,
        frozenset({"decode", "window"}): True}
    attention.set_fused_prefix_part("cpu", ())
    made_by_position = layouts[frozenset({"window"})][1]
    assert torch.equal(window(made_by_position), window(layouts[frozenset()][1]))


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"])
def test_a_dense_slot_reads_nothing_of_the_positions_it_holds_out(tier, tmp_path):
    """What a prefill window leaves unmade (PrefixLayer.with_context's unread columns) is
    never read where the slot says it ignores writes there: positions written as NaN inside
    its held-out range come back nowhere; a compressed or rounding slot, or a range past what
    it holds out, says no."""
    from flexgen_helm.executor.kv_cache import KVCacheSlot
    from flexgen_helm.memory.devices import pick_devices
    from flexgen_helm.memory.usage import TierUsage

    devices, units = pick_devices("cpu", "float32"), {"gpu": 0, "cpu": 0, "disk": 0}
    units[tier] = 4

    def slot(**kw):
        return KVCacheSlot(units, 30, 8, devices, TierUsage(), tmp_path / f"kv-{len(kw)}.bin", False,
                           held_out=(3, 20), **kw)

    plain = slot()
    assert plain.ignores_writes_to(3, 20) and plain.ignores_writes_to(5, 12)
    assert not plain.ignores_writes_to(2, 12) and not plain.ignores_writes_to(5, 21)
    assert not slot(compression=Compression(4, 8, cache_grouping="per-token")).ignores_writes_to(5, 12)
    assert not slot(rounding=Compression(8, 8, cache_grouping="per-token")).ignores_writes_to(5, 12)
    k, v = torch.randn(25, 4, 8), torch.randn(25, 4, 8)
    k[3:20], v[3:20] = math.nan, math.nan
    plain.write(k, v, 0)
    held_k, held_v = plain.read(tier, 25)
    want = torch.cat([torch.arange(3), torch.arange(20, 25)])
    assert torch.equal(held_k, k[want]) and torch.equal(held_v, v[want])
    plain.close()


def test_shared_prefix_attention_over_a_slot_that_holds_out_the_common_prefix():
    """A tier's units (any run of them, cutting sequences) over a cache without the positions
    every sequence's prefix covers: what plain attention over each whole cache computes."""

    from flexgen_helm.executor.attention import DecodePrefix, attend, attend_past_shared_prefix
    from flexgen_helm.executor.kv_cache import keys_outside_prefix

    q, k, v, valid, prefix_k, prefix_v, starts = caches_holding_a_prefix(3)
    want = attend(q, k, v, valid, causal=False)
    kvh, n = prefix_k.shape[0], prefix_k.shape[1]
    a, b = int(starts.max()), int(starts.min()) + n  # held out: every copy covers them
    held = torch.cat([torch.arange(a), torch.arange(b, k.shape[1])])
    for first, last in [(0, 10), (3, 8), (1, 2)]:
        own = keys_outside_prefix(valid[first:last, held], starts[torch.arange(first, last) // kvh], n, (a, b))
        got = attend_past_shared_prefix(q[first:last], k[first:last, held], v[first:last, held], own,
                                        DecodePrefix(prefix_k, prefix_v), first_unit=first)
        assert torch.allclose(got, want[first:last], atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["our products", "the fused kernel"])
def test_a_bf16_decode_step_past_a_prefix_is_float32_attention_to_bf16_rounding_for_any_run_of_units(fused,
                                                                                                   monkeypatch):
    """In bfloat16 over a bf16 cache that holds out the common prefix, for any run of units
    (a tier's, cutting sequences): within bf16 rounding of float32 attention over the same
    values, where the decode call runs on torch's fused kernel (attention.FUSED_PREFIX_PART:
    the prefix part and the own keys, merged by a lerp) as on our products."""
    from flexgen_helm.executor import attention
    from flexgen_helm.executor.attention import attend, attend_past_shared_prefix, prefix_for_decode
    from flexgen_helm.executor.kv_cache import keys_outside_prefix

    q, k, v, valid, prefix_k, prefix_v, starts = (
        x.bfloat16().float() if x.is_floating_point() else x for x in caches_holding_a_prefix(4))
    want = attend(q, k, v, valid, causal=False)
    attention.set_fused_prefix_part("cpu", {"decode"} if fused else ())
    prefix = prefix_for_decode(prefix_k, prefix_v, torch.device("cpu"), torch.bfloat16)
    if prefix.key_mean is None:
        pytest.skip("this CPU emulates bf16 matmuls: the float32 layout serves it")
    calls = []
    real = attention._fused_past_prefix
    monkeypatch.setattr(attention, "_fused_past_prefix", lambda *a: calls.append(1) or real(*a))
    kvh, n = prefix_k.shape[0], prefix_k.shape[1]
    a, b = int(starts.max()), int(starts.min()) + n  # held out: every copy covers them
    held = torch.cat([torch.arange(a), torch.arange(b, k.shape[1])])
    for first, last in [(0, 10), (3, 8), (1, 2)]:
        own = keys_outside_prefix(valid[first:last, held], starts[torch.arange(first, last) // kvh], n, (a, b))
        got = attend_past_shared_prefix(q[first:last].bfloat16(), k[first:last, held].bfloat16(),
                                        v[first:last, held].bfloat16(), own, prefix, first_unit=first)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want[first:last]).abs().max() < 2e-2
    # the cache as the schedule reads it in place: a view of a (positions, units, d) slot
    slot_k, slot_v = (x.transpose(0, 1).bfloat16().contiguous() for x in (k, v))
    own = keys_outside_prefix(valid[3:8], starts[torch.arange(3, 8) // kvh], n)
    got = attend_past_shared_prefix(q[3:8].bfloat16(), slot_k[:, 3:8].transpose(0, 1), slot_v[:, 3:8].transpose(0, 1),
                                    own, prefix, first_unit=3)
    assert (got.float() - want[3:8]).abs().max() < 2e-2
    # a unit that sees none of its own keys: the prefix's part alone
    own[1] = False
    alone = attend(q[4:5], prefix_k.repeat(kvh, 1, 1)[4 % kvh:4 % kvh + 1], prefix_v[4 % kvh:4 % kvh + 1],
                   torch.ones(1, n, dtype=torch.bool), causal=False)
    got = attend_past_shared_prefix(q[3:8].bfloat16(), slot_k[:, 3:8].transpose(0, 1), slot_v[:, 3:8].transpose(0, 1),
                                    own, prefix, first_unit=3)
    assert (got[1].float() - alone[0]).abs().max() < 2e-2
    assert len(calls) == (5 if fused else 0)


def _value_rows(values, asked: list):
    """A ValueRows over values (u, t, d) that notes the columns it is asked for."""
    def rows(columns: list[int]):
        asked.append(columns)
        return values[:, columns]
    return rows


@pytest.mark.parametrize("keep_fraction", [1.0, 0.3])
def test_held_prefix_attention_is_attention_over_each_whole_cache(keep_fraction):
    """The prefix's one copy and each unit's own keys (its copy masked out), for any run of
    units: what attend() computes over each whole cache, sparse top-k included (global over
    both parts: the keys a unit may see count the prefix's), the values of kept prefix keys
    read from its copy, the units' own asked for (a ValueRows) at their own columns only."""
    from flexgen_helm.executor.attention import attend, attend_past_held_prefix

    q, k, v, valid, prefix_k, prefix_v, starts = caches_holding_a_prefix(4)
    want = attend(q, k, v, valid, causal=False, keep_fraction=keep_fraction)
    kvh, n = prefix_k.shape[:2]
    positions = torch.arange(k.shape[1])[None, :]
    for first, last in [(0, 10), (3, 8), (1, 2)]:
        unit_starts = starts[torch.arange(first, last) // kvh][:, None]
        own = valid[first:last] & ((positions < unit_starts) | (positions >= unit_starts + n))
        asked = []
        got = attend_past_held_prefix(q[first:last], k[first:last], _value_rows(v[first:last], asked), own,
                                      prefix_k, prefix_v, first_unit=first, keep_fraction=keep_fraction)
        assert torch.allclose(got, want[first:last], atol=1e-6)
        if keep_fraction < 1:  # kept own keys' columns, never the copies of the prefix the slot still holds
            assert asked and set(asked[0]) <= set(own.any(0).nonzero().flatten().tolist())


def test_a_block_holds_the_shared_prefix_kv_once(tiny_llama, tmp_path):
    """Its slots leave out the positions every row's copy of the prefix covers: the cache of
    a block of few-shot prompts takes about its suffixes' and generated tokens' bytes."""
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    peaks = []
    for sharing in (False, True):
        engine = _engine(tiny_llama, Policy(gpu_batch_size=16, cache=Split(0, 1, 0)), tmp_path, sharing)
        engine.runtime.usage.reset_peak()
        weights = engine.runtime.usage.current["cpu"]
        engine.generate(PROMPTS, params)
        peaks.append(engine.runtime.usage.peak["cpu"] - weights)
    cfg = engine.config
    per_position = 2 * cfg.num_layers * len(PROMPTS) * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32
    longest = max(map(len, PROMPTS))
    # without sharing, every row holds every position; with it, all but the (len(PREFIX) - 6)
    # positions where every row's copy of the prefix lies (the rows' paddings differ by 6)
    assert peaks[0] - peaks[1] >= (len(PREFIX) - (longest - min(map(len, PROMPTS)))) * per_position
    assert peaks[0] >= (longest + N_NEW) * per_position


@pytest.mark.parametrize("name", ["kivi-cache", "per-token-cache-8bit", "sparse", "compressed-cache-split-delegated"])
def test_a_compressed_or_sparse_block_holds_the_shared_prefix_once(tiny_llama, tmp_path, name):
    """Under cache compression and sparse attention too, a block's slots leave out the prefix
    positions every row's copy covers (KIVI: the prefix's complete groups, every row's first
    ones whatever its padding): its cache, here on the cpu and disk tiers, takes exactly
    their bytes less (the one copy, stored as the slots store it, is the compute tier's)."""
    policy = dataclasses.replace(POLICIES[name], gpu_batch_size=16, num_gpu_batches=1, cache=Split(0, 0.5, 0.5))
    taken = []
    for sharing in (False, True):
        engine = _engine(tiny_llama, policy, tmp_path, sharing)
        usage = engine.runtime.usage
        usage.reset_peak()
        before = usage.current["cpu"] + usage.current["disk"]
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
        taken.append(usage.peak["cpu"] + usage.peak["disk"] - before)
    cfg, cc = engine.config, policy.compress_cache
    (block,) = plan_blocks([len(p) for p in PROMPTS], policy)  # one block, of GPU batches of similar lengths
    longest = max(map(len, PROMPTS)) + N_NEW  # the positions each slot is made for

    def slot_saves(batch: list[int]) -> int:
        lengths = [len(PROMPTS[i]) for i in batch]
        # the positions every row's copy covers: the rows' paddings differ by max - min
        held = len(PREFIX) // cc.group_size * cc.group_size if cc is not None and cc.kivi else \
            len(PREFIX) - (max(lengths) - min(lengths))
        assert held > 0
        units = len(batch) * cfg.num_kv_heads
        return (kv_nbytes(longest, units, cfg.head_dim, torch.float32, cc)
                - kv_nbytes(longest - held, units, cfg.head_dim, torch.float32, cc))

    assert taken[0] - taken[1] == cfg.num_layers * sum(map(slot_saves, block))


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16], ids=["float32 cache", "bf16 cache"])
@pytest.mark.parametrize("fused", [False, True], ids=["our products", "the fused kernel"])
def test_shared_prefix_attention_in_bf16_keeps_float32_precision_of_the_keys_shared_part(fused, cache, monkeypatch):
    """The bf16 layout (a bf16 model on a CPU) takes the keys' mean out before rounding: with
    keys that share a large component, as trained models' do, the output stays as close to
    float32 attention as bf16 inputs allow, where rounding the plain scores would not; on our
    products and, where decode steps take torch's fused kernel (attention.FUSED_PREFIX_PART),
    on it: the whole call over a bf16 cache (the own keys on the kernel too), the prefix part
    over a float32 one (a loaded cache's unpacked copy) taking our products."""
    from flexgen_helm.executor import attention
    from flexgen_helm.executor.attention import (
        DecodePrefix,
        attend,
        attend_past_shared_prefix,
        prefix_for_decode,
    )
    from flexgen_helm.executor.kv_cache import keys_outside_prefix
    from flexgen_helm.memory.devices import cpu_has_bf16_arithmetic

    torch.manual_seed(2)
    sequences, kvh, r, d, n = 4, 2, 3, 64, 300
    starts = torch.tensor([0, 2, 1, 2])
    t = int(starts.max()) + n + 5
    shared = 12 * torch.randn(kvh, 1, d)  # the component every key of a head shares
    prefix_k, prefix_v = shared + torch.randn(kvh, n, d), torch.randn(kvh, n, d)
    k, v = torch.randn(sequences * kvh, t, d), torch.randn(sequences * kvh, t, d)
    valid = torch.ones(sequences * kvh, t, dtype=torch.bool)
    for unit in range(sequences * kvh):
        s, h = int(starts[unit // kvh]), unit % kvh
        k[unit, s:s + n], v[unit, s:s + n], valid[unit, :s] = prefix_k[h], prefix_v[h], False
        k[unit, :s] += shared[h]
        k[unit, s + n:] += shared[h]
    if cache == torch.bfloat16:  # the float32 attention of the values the bf16 cache holds
        k, v, prefix_k, prefix_v = (x.bfloat16().float() for x in (k, v, prefix_k, prefix_v))
    q = torch.randn(sequences * kvh, r, 1, d).bfloat16()
    want = attend(q.float(), k, v, valid, causal=False)
    k, v = k.to(cache), v.to(cache)
    attention.set_fused_prefix_part("cpu", {"decode"} if fused else ())
    calls = []
    real = attention._fused_past_prefix
    monkeypatch.setattr(attention, "_fused_past_prefix", lambda *a: calls.append(1) or real(*a))
    bf16 = prefix_for_decode(prefix_k, prefix_v, torch.device("cpu"), torch.bfloat16)
    assert (bf16.key_mean is not None) == cpu_has_bf16_arithmetic()
    if bf16.key_mean is None:
        pytest.skip("this CPU emulates bf16 matmuls: the float32 layout serves it (checked above)")
    own = keys_outside_prefix(valid, starts[torch.arange(q.shape[0]) // kvh], n)
    got = attend_past_shared_prefix(q, k, v, own, bf16).float()
    assert bool(calls) == (fused and cache == torch.bfloat16)
    err = (got - want).abs().max().item()
    assert err < 1e-2, err
    # what rounding the plain scores to bf16 would have cost: the mean is what keeps it small
    plain = DecodePrefix(prefix_k.mul(d ** -0.5 / math.log(2)).bfloat16(), prefix_v.bfloat16(),
                         torch.zeros(kvh, 1, d), by_position=True)
    rounded = attend_past_shared_prefix(q, k, v, own, plain).float()
    assert (rounded - want).abs().max().item() > 3 * err


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_a_bf16_prefix_part_takes_its_weights_unshifted_only_where_they_stay_normal_floats(scale, monkeypatch):
    """The prefix part in bf16 takes its weights without each row's peak where its scores
    allow (scale 1: within bf16 rounding of the float32 attention) and with the peak out
    where unshifted weights would leave the floats (scale 40: scores of several hundred in
    base 2, where exp2 overflows): then the softmax of its bf16 scores, finite, as exact as
    those scores allow."""
    from flexgen_helm.executor import attention
    from flexgen_helm.executor.attention import prefix_for_decode
    from flexgen_helm.memory.devices import cpu_has_bf16_arithmetic

    if not cpu_has_bf16_arithmetic():
        pytest.skip("this CPU emulates bf16 matmuls: the float32 layout serves it")
    torch.manual_seed(3)
    kvh, m, d, n = 2, 40, 64, 500
    keys, values = torch.randn(kvh, n, d), torch.randn(kvh, n, d)
    q = scale * torch.randn(kvh, m, d)
    prefix = prefix_for_decode(keys, values, torch.device("cpu"), torch.bfloat16)
    shifted = []
    real = attention._shifted_bf16_prefix_part
    monkeypatch.setattr(attention, "_shifted_bf16_prefix_part", lambda *a: shifted.append(1) or real(*a))
    out, lse = attention._bf16_prefix_part(q, prefix)
    assert bool(shifted) == (scale > 1)
    if scale == 1:
        scores = (q.double() @ keys.double().transpose(1, 2)) / math.sqrt(d)
    else:  # the layout's bf16 scores (base 2, relative to the keys' mean), back in natural units
        rounded = torch.bmm(q.bfloat16(), prefix.keys).double() * math.log(2)
        scores = rounded + (q.double() @ prefix.key_mean.double().transpose(1, 2))
    want_out, want_lse = scores.softmax(-1) @ values.double(), scores.logsumexp(-1, keepdim=True)
    assert (out.double() - want_out).abs().max().item() < 0.03
    assert ((lse.double() - want_lse).abs() / want_lse.abs().clamp(min=1)).max().item() < 1e-3


def _planning_profile():
    """A hand-made bf16 CPU profile for the planner (24 GiB of RAM, 100 GiB of disk)."""
    from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile

    gib = 2**30
    speeds = DeviceSpeeds(matmul_flops={"bfloat16": {1: 2e9, 16: 30e9, 256: 200e9, 4096: 300e9}},
                          attn_prefill_flops=100e9, attn_decode_bytes_per_s=5e9)
    return HardwareProfile(devices={"cpu": speeds}, memcpy_bytes_per_s=5e9, disk_read_bytes_per_s=1e9,
                           disk_write_bytes_per_s=5e8, cpu_mem_bytes=24 * gib, cpu_available_bytes=20 * gib,
                           disk_free_bytes=100 * gib)


def test_the_planner_counts_a_shared_prefix_once_and_fits_bigger_blocks():
    """Under the same memory budget, prompts whose first 1,000 of 1,024 tokens are the same
    let the search pick a block of at least twice the sequences (their KV is held once)."""

    from flexgen_helm.models.opt import config_for_size
    from flexgen_helm.planner.budget import planned_bytes
    from flexgen_helm.planner.search import SearchOptions, default_budgets, search

    gib = 2**30
    profile = _planning_profile()
    cfg = config_for_size("125m")
    budgets = default_budgets(profile, cpu=3 * gib, disk=0)
    options = SearchOptions(max_gpu_batch_size=256, max_num_gpu_batches=16)
    plain, shared = (search(cfg, profile, 1024, 32, budgets, options, shared_prefix=p) for p in (0, 1000))
    assert shared.policy.block_size >= 2 * plain.policy.block_size
    # what it counts: a block's cache without the prefix's positions, and the prefix once
    once = planned_bytes(cfg, shared.policy, 1056, torch.bfloat16, shared_prefix=1000)
    each = planned_bytes(cfg, shared.policy, 1056, torch.bfloat16)
    assert sum(each.values()) - sum(once.values()) > 0.9 * (shared.policy.block_size - 1) * 1000 * (
        2 * cfg.num_layers * cfg.hidden_size * 2)
    # a compressed cache holds it once too, in its compressed bytes (KIVI: its 960 tokens of whole groups of 64)
    for grouping, held in (("kivi", 960), ("per-token", 1000)):
        cc = Compression(4, 64, cache_grouping=grouping)
        compressed = dataclasses.replace(shared.policy, compress_cache=cc)
        saved = sum(planned_bytes(cfg, compressed, 1056, torch.bfloat16).values()) - \
            sum(planned_bytes(cfg, compressed, 1056, torch.bfloat16, shared_prefix=1000).values())
        per_sequence = cfg.num_layers * (kv_nbytes(64, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, cc)
                                         - kv_nbytes(0, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, cc)) / 64
        assert saved > 0.9 * (compressed.block_size - 1) * held * per_sequence


def test_a_prefix_whose_one_copy_fits_no_block_is_computed_per_sequence_and_the_plan_says_why():
    """The prefix's one copy sits on the compute tier; with the cache offloaded to the CPU
    the per-sequence copies fit where that one does not: the planner turns sharing off and
    says why, rather than failing; a user who pinned sharing on gets the error."""
    from flexgen_helm.errors import PolicyError
    from flexgen_helm.models.opt import config_for_size
    from flexgen_helm.planner.auto import CommandWorkload, searched_policy

    profile = _planning_profile()
    cfg = config_for_size("125m")
    placed = {"weights": {"gpu": 1, "cpu": 0, "disk": 0}, "cache": {"gpu": 0, "cpu": 1, "disk": 0},
              "activations": {"gpu": 1, "cpu": 0, "disk": 0}}
    work = CommandWorkload(2000, 32, 64, shared_prefix=1990)
    budgets = {"gpu": "400MiB", "cpu": "4GiB"}
    policy, result = searched_policy(cfg, work, placed, profile, budgets, dtype=torch.bfloat16)
    assert not policy.prefix_sharing
    assert "1990 tokens every prompt starts with are computed and held per sequence" in result.unshared_because
    roomy, result = searched_policy(cfg, work, placed, profile, {"gpu": "2GiB", "cpu": "4GiB"}, dtype=torch.bfloat16)
    assert roomy.prefix_sharing and not result.unshared_because
    with pytest.raises(PolicyError, match="does not fit the memory budgets"):
        searched_policy(cfg, work, {**placed, "prefix_sharing": True}, profile, budgets, dtype=torch.bfloat16)


def test_bench_refuses_a_shared_prefix_that_leaves_no_prompt_token(capsys):
    from flexgen_helm.cli import main

    assert main(["bench", "--model", "facebook/opt-125m", "--dummy", "--prompt-len", "8",
                 "--shared-prefix", "8"]) == 2
    assert "--shared-prefix 8 must leave every prompt a token of its own" in capsys.readouterr().err
