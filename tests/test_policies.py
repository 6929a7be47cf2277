"""The policy never changes the answer: every placement, block shape, overlap setting and
CPU delegation gives the same tokens, and (in fp32) the same log-probs to rounding."""

from __future__ import annotations

import math

import pytest

from flexgen_helm.engine import Engine
from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split

# mixed lengths; 7 prompts is not a multiple of any block below
PROMPTS = [[5, 17, 3, 44, 9, 21, 8, 2, 60], [12, 7], [30, 31, 32, 33], [1, 2, 3], [40] * 11, [8, 9, 10, 11, 12], [70]]
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


@pytest.fixture(scope="module")
def reference(model_path):
    engine = Engine.load(str(model_path), Policy(overlap=False), dtype="float32", device="cpu", progress=False)
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)).results


@pytest.mark.parametrize("name", list(POLICIES))
def test_same_tokens_and_logprobs_under_every_policy(model_path, reference, name, tmp_path):
    engine = Engine.load(str(model_path), POLICIES[name], dtype="float32", device="cpu", offload_dir=tmp_path,
                         progress=False)
    got = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)).results
    for r, ref in zip(got, reference):
        assert r.completions[0].token_ids == ref.completions[0].token_ids
        assert r.completions[0].logprobs == pytest.approx(ref.completions[0].logprobs, abs=1e-4)
    assert list(tmp_path.glob("run-*")) == []  # runtime files are cleaned up


def test_sampling_with_seed_is_policy_independent(tiny_llama, tmp_path):
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True,
                            num_completions=2)
    outs = []
    for policy in (Policy(), POLICIES["everything-split-no-overlap"]):
        engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cpu", offload_dir=tmp_path,
                             progress=False)
        outs.append([[c.token_ids for c in r.completions] for r in engine.generate(PROMPTS, params).results])
    assert outs[0] == outs[1]


def test_placement_is_honest(tiny_opt, tmp_path):
    policy = Policy(weights=Split(0.2, 0.5, 0.3))
    engine = Engine.load(str(tiny_opt), policy, dtype="float32", device="cpu", offload_dir=tmp_path, progress=False)
    frac = engine.memory_report()["placement"]["weight_fractions"]
    assert frac["gpu"] == pytest.approx(0.2, abs=0.02)
    assert frac["cpu"] == pytest.approx(0.5, abs=0.02)
    assert frac["disk"] == pytest.approx(0.3, abs=0.02)


def test_scoring_from_a_position_returns_those_logprobs_and_nothing_before(tiny_llama, tmp_path):
    """first_scored (LAMBADA's last word): the same log-probs and top entries as a full
    score from that token on, nan and no entries before it, whatever the padding."""
    engine = Engine.load(str(tiny_llama), Policy(gpu_batch_size=4, num_gpu_batches=2), dtype="float32", device="cpu",
                         offload_dir=tmp_path, progress=False)
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
