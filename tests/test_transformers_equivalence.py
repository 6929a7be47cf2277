"""Our OPT and Llama math agrees with transformers' on the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import engine_device, hf_model, save_tiny

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy

PROMPTS = [[5, 17, 3, 44, 9, 21, 8], [12, 7], [30, 31, 32, 33]]


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def _check_scores(engine: Engine, model, prompts, tol=1e-4):
    for ids, got in zip(prompts, engine.score(prompts).results):
        ref = _hf_logprobs(model, ids)
        want = [math.nan] + [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert math.isnan(got.logprobs[0])
        assert got.logprobs[1:] == pytest.approx(want[1:], abs=tol)


def _check_greedy(engine: Engine, model, prompts, n=6):
    results = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True)).results
    for ids, r in zip(prompts, results):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        assert r.completions[0].token_ids == out[0, len(ids):].tolist()


@pytest.mark.parametrize("overrides", [{}, {"do_layer_norm_before": False, "word_embed_proj_dim": 16}],
                         ids=["opt-pre-ln", "opt-350m-style"])
def test_opt_matches_transformers(tmp_path, overrides):
    path = save_tiny("opt", tmp_path / "m", **overrides)
    model = hf_model(path)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2)
    engine = Engine.load(str(path), policy, dtype="float32", device=engine_device(), progress=False)
    _check_scores(engine, model, PROMPTS)
    _check_greedy(engine, model, PROMPTS)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_llama_family_matches_transformers(tmp_path, kind):
    path = save_tiny(kind, tmp_path / "m")
    model = hf_model(path)
    engine = Engine.load(str(path), Policy(gpu_batch_size=3), dtype="float32", device=engine_device(), progress=False)
    _check_scores(engine, model, PROMPTS)
    _check_greedy(engine, model, PROMPTS)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    path = save_tiny("llama", tmp_path / "m", rope_scaling=scaling, tie_word_embeddings=True)
    model = hf_model(path)
    engine = Engine.load(str(path), Policy(), dtype="float32", device=engine_device(), progress=False)
    _check_scores(engine, model, PROMPTS)
