"""A sequence that is done (its max_tokens, a stop token, a stop condition) leaves its GPU
batch's compute: the others' completions do not change, and no step computes it again;
also where sliding-window blocks keep their cache in rings (Gemma 3), which a step never
reads in place, on disk, compressed and with sparse attention."""

from __future__ import annotations

import pytest

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Compression, Policy, Split

PROMPTS = [[5, 17, 3, 44, 9, 21, 8, 2, 60], [12, 7], [30, 31, 32, 33], [1, 2, 3], [40] * 11, [8, 9, 10, 11, 12],
           [70], [3, 3, 4]]
LONGEST = 8
# per prompt: max_new_tokens; prompts 2 and 6 also stop early (a stop condition, a stop token)
MAX_NEW = [1, 3, 8, 2, 5, 8, 6, 2]

POLICIES = {
    "one-batch": Policy(gpu_batch_size=8, num_gpu_batches=1),
    "3-batches-cache-cpu-disk-delegated": Policy(gpu_batch_size=3, num_gpu_batches=3, cache=Split(0.2, 0.5, 0.3),
                                                 cpu_cache_compute=True),
    "2-batches-cache-disk-no-overlap": Policy(gpu_batch_size=4, num_gpu_batches=2, cache=Split(0, 0, 1),
                                              overlap=False),
    "cache-compressed-split": Policy(gpu_batch_size=2, num_gpu_batches=4, cache=Split(0.5, 0.5, 0),
                                     compress_cache=Compression(4, 16)),
    "sparse-disk-values": Policy(gpu_batch_size=4, num_gpu_batches=2, cache=Split(0.5, 0, 0.5), attn_sparsity=0.5),
}


class AfterTokens:
    def __init__(self, n: int):
        self.n = n

    def reached(self, token_ids) -> bool:
        return len(token_ids) >= self.n


def _expected(full: list[int], max_new: int, stop_token: int | None, stop_after: int | None):
    """What a run that stops sequence by sequence must give, from a run where none stopped."""
    tokens = full[:max_new]
    if stop_token is not None and stop_token in tokens:
        return tokens[:tokens.index(stop_token)], "stop"
    if stop_after is not None and stop_after <= len(tokens):
        return tokens[:stop_after], "stop_condition"
    return tokens, "length"


@pytest.fixture(params=["llama", "gemma3"])
def model_path(request):
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.mark.parametrize("name", list(POLICIES))
def test_finished_sequences_leave_the_batch_and_the_rest_is_unchanged(model_path, name, tmp_path):
    engine = Engine.load(str(model_path), POLICIES[name], dtype="float32", device="cpu", offload_dir=tmp_path,
                         progress=False)
    ref = engine.generate(PROMPTS, SamplingParams(max_new_tokens=LONGEST, ignore_eos=True))
    full = [r.completions[0] for r in ref.results]
    assert ref.stats.padded_generated_tokens == LONGEST * len(PROMPTS)
    stop_token = full[6].token_ids[3]  # a token prompt 6 generates: its "EOS"
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    params[2] = SamplingParams(max_new_tokens=MAX_NEW[2], ignore_eos=True, stop=AfterTokens(4))
    params[6] = SamplingParams(max_new_tokens=MAX_NEW[6], stop_token_ids=(stop_token,), ignore_eos=True)
    run = engine.generate(PROMPTS, params)
    computed = 0
    for i, (result, want) in enumerate(zip(run.results, full)):
        got = result.completions[0]
        tokens, reason = _expected(want.token_ids, MAX_NEW[i], stop_token if i == 6 else None, 4 if i == 2 else None)
        assert (got.token_ids, got.finish_reason) == (tokens, reason), f"prompt {i}"
        assert got.logprobs == pytest.approx(want.logprobs[:len(tokens)], abs=1e-4)
        computed += len(tokens) + (reason == "stop")  # a stop token is computed, not kept
    # each sequence was computed for its own steps only, not the block's longest
    assert run.stats.padded_generated_tokens == computed < LONGEST * len(PROMPTS)


def test_opt_finished_sequences_leave_the_batch(tiny_opt, tmp_path):
    engine = Engine.load(str(tiny_opt), POLICIES["3-batches-cache-cpu-disk-delegated"], dtype="float32",
                         device="cpu", offload_dir=tmp_path, progress=False)
    full = engine.generate(PROMPTS, SamplingParams(max_new_tokens=LONGEST, ignore_eos=True)).results
    run = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW])
    assert [r.completions[0].token_ids for r in run.results] == \
        [f.completions[0].token_ids[:n] for f, n in zip(full, MAX_NEW)]
    assert run.stats.padded_generated_tokens == sum(MAX_NEW)


# prompts of one length share a GPU batch, whose sequences then finish at different steps,
# the first ones not last in the batch: the rows still computing are a subset that changes
# (a tier read in place packs their cache units together: kv_cache.KVCacheSlot._pack)
SAME_LENGTH = [[5, 17, 3, 44, 9], [12, 7, 30, 31, 32], [40, 41, 42, 43, 44], [1, 2, 3, 4, 5], [70, 6, 60, 50, 8],
               [8, 9, 10, 11, 12]]
SAME_LENGTH_MAX_NEW = [2, 7, 3, 8, 1, 5]
SHRINKING = {
    "one-batch": Policy(gpu_batch_size=8, num_gpu_batches=1),
    "cache-gpu-cpu-disk": Policy(gpu_batch_size=6, num_gpu_batches=1, cache=Split(0.4, 0.4, 0.2)),
    "cpu-delegated": Policy(gpu_batch_size=6, num_gpu_batches=1, cache=Split(0.5, 0.5, 0), cpu_cache_compute=True),
    # a cache held dense, rounded as written (attended to as computed, then rewritten rounded)
    "rounded-cache": Policy(gpu_batch_size=6, num_gpu_batches=1, keep_dense_cache=True,
                            compress_cache=Compression(8, 8, cache_grouping="per-token")),
    # ... split over two tiers, each packing its own computed units (a rewrite's run of units per tier)
    "rounded-cache-gpu-cpu": Policy(gpu_batch_size=6, num_gpu_batches=1, keep_dense_cache=True,
                                    cache=Split(0.5, 0.5, 0),
                                    compress_cache=Compression(8, 8, cache_grouping="per-token")),
    # groups of 3 (2 values round exactly to a 4-bit min/max grid): each rounded in place once
    # complete, in the packed columns once some sequences finished
    "kivi-held-dense": Policy(gpu_batch_size=6, num_gpu_batches=1, keep_dense_cache=True,
                              compress_cache=Compression(4, 3, cache_grouping="kivi")),
    # KIVI groups on every tier: the computed units' writes only, but on disk
    "kivi-gpu-cpu-disk": Policy(gpu_batch_size=6, num_gpu_batches=1, cache=Split(0.4, 0.4, 0.2),
                                compress_cache=Compression(4, 2, cache_grouping="kivi")),
}


@pytest.mark.parametrize("name", list(SHRINKING))
def test_a_batch_whose_rows_finish_one_by_one_computes_the_rest_unchanged(model_path, name, tmp_path):
    engine = Engine.load(str(model_path), SHRINKING[name], dtype="float32", device="cpu", offload_dir=tmp_path,
                         progress=False)
    full = engine.generate(SAME_LENGTH, SamplingParams(max_new_tokens=max(SAME_LENGTH_MAX_NEW), ignore_eos=True))
    run = engine.generate(SAME_LENGTH, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in SAME_LENGTH_MAX_NEW])
    for result, want, n in zip(run.results, full.results, SAME_LENGTH_MAX_NEW):
        assert result.completions[0].token_ids == want.completions[0].token_ids[:n]
        assert result.completions[0].logprobs == pytest.approx(want.completions[0].logprobs[:n], abs=1e-5)
    assert run.stats.padded_generated_tokens == sum(SAME_LENGTH_MAX_NEW)
