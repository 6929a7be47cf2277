"""Gemma 2, Gemma 3, Qwen3, Phi-3 and the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, gpt-oss) agree with transformers on small random weights, under
every kind of placement, and with 4-bit weights as a simulated quantization would; a
sliding-window block's KV cache never grows past its window."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_device, fake_quantized_checkpoint, hf_model, save_tiny

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.models.gemma import config_from_hf as gemma_config
from flexgen_helm.planner.budget import planned_components
from flexgen_helm.policy import Policy, Split
from flexgen_helm.policy.policy import Compression
from flexgen_helm.weights.hf_checkpoint import HFCheckpoint

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]
# longer than the tiny models' sliding windows (4 and 6 positions); all within Phi-3's
# pretraining context of 16 with the generated tokens (its short LongRoPE factors)
PROMPTS = [[5, 17, 3, 44, 9, 21, 8, 2, 60], [12, 7], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42]]
N_NEW = 6
POLICIES = {
    "compute-tier": Policy(gpu_batch_size=4),
    "weights-cpu-disk": Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0.0, 0.4, 0.6)),
    "cache-disk-delegated": Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 0, 1), cpu_cache_compute=True),
    "all-split-no-overlap": Policy(gpu_batch_size=3, weights=Split(0.2, 0.3, 0.5), cache=Split(0.3, 0.3, 0.4),
                                   activations=Split(0.5, 0.25, 0.25), overlap=False, cpu_cache_compute=True),
}
F32 = dict(dtype="float32", device=engine_device(), progress=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: torch's second thread only spins, and on a shared machine's load it
    made these tests 20x slower (0.6 s against 12 s for one policy's run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(kind, checkpoint, transformers' log-probs of PROMPTS, its greedy continuations)."""
    path = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    model = hf_model(path)
    return (request.param, path, [_reference_logprobs(model, p) for p in PROMPTS],
            [_reference_greedy(model, p, N_NEW) for p in PROMPTS])


def _reference_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _reference_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()


def _check(engine: Engine, logprobs: list, greedy: list, n=N_NEW) -> None:
    for want, got in zip(logprobs, engine.score(PROMPTS).results):
        assert got.logprobs[1:] == pytest.approx(want, abs=1e-4)
    run = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert [r.completions[0].token_ids for r in run.results] == greedy


@pytest.mark.parametrize("policy", list(POLICIES))
def test_family_matches_transformers(family, policy, tmp_path):
    _, path, logprobs, greedy = family
    engine = Engine.load(str(path), POLICIES[policy], offload_dir=tmp_path, **F32)
    _check(engine, logprobs, greedy)


def test_4bit_weights_equal_simulated_quantization(family, tmp_path):
    kind, path, _, _ = family
    cfg = Compression(4, 16)
    base = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0.3, 0.3, 0.4))
    policy = Policy.from_dict({**base.to_dict(), "compress_weight": cfg.__dict__})
    reference = Engine.load(str(fake_quantized_checkpoint(path, tmp_path / "fq", cfg)), base,
                            offload_dir=tmp_path / "ref", **F32)
    engine = Engine.load(str(path), policy, offload_dir=tmp_path / "q", **F32)
    for got, want in zip(engine.score(PROMPTS).results, reference.score(PROMPTS).results):
        assert got.logprobs[1:] == pytest.approx(want.logprobs[1:], abs=1e-4)
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    for got, want in zip(engine.generate(PROMPTS, params).results, reference.generate(PROMPTS, params).results):
        assert got.completions[0].token_ids == want.completions[0].token_ids


def test_phi3_long_rope_factors_past_the_pretraining_context(tmp_path):
    # prompts longer than original_max_position_embeddings (16): the long factors, in both
    path = save_tiny("phi3", tmp_path / "m")
    model = hf_model(path)
    prompts = [list(range(3, 23)), list(range(40, 58))]
    engine = Engine.load(str(path), Policy(gpu_batch_size=2), offload_dir=tmp_path, **F32)
    for ids, got in zip(prompts, engine.score(prompts).results):
        assert got.logprobs[1:] == pytest.approx(_reference_logprobs(model, ids), abs=1e-4)


def test_sliding_window_cache_stays_within_its_window(tmp_path):
    """Gemma 3's local blocks (window 4) hold 4 positions on whichever tier; the global one
    the whole run. What the engine allocates (its disk tier holds the whole cache here) is
    what the budget plans."""
    path = save_tiny("gemma3", tmp_path / "m")
    model = hf_model(path)
    policy = Policy(gpu_batch_size=4, cache=Split(0, 0, 1), cpu_cache_compute=True)
    engine = Engine.load(str(path), policy, offload_dir=tmp_path, **F32)
    cfg = engine.runtime.config
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [4, 4, 0, 4]
    _check(engine, [_reference_logprobs(model, p) for p in PROMPTS],
           [_reference_greedy(model, p, 8) for p in PROMPTS], n=8)
    max_len = max(len(p) for p in PROMPTS) + 8
    planned = planned_components(cfg, policy, max_len, torch.float32)["cache"]["disk"]
    units, elt = 4 * cfg.num_kv_heads, 4  # one GPU batch of four sequences, float32
    per_position = 2 * units * cfg.head_dim * elt  # K and V
    assert planned == per_position * (3 * 4 + max_len)  # three local blocks of 4 positions, one global
    assert engine.memory_report()["tiers"]["disk"]["peak_bytes"] == planned


def test_gemma3_config_of_older_checkpoints():
    """Configs written before transformers 5: rope_theta / rope_local_base_freq /
    rope_scaling and sliding_window_pattern instead of per-layer-type rope_parameters and
    layer_types; a multimodal Gemma 3 keeps its text model in text_config."""
    text = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 7, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 64, "head_dim": 16, "sliding_window": 512,
            "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 16}
    cfg = gemma_config({"model_type": "gemma3", "text_config": text}, "g")
    assert cfg.sliding_windows == (512,) * 5 + (0, 512)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling_dict) == (
        1_000_000.0, 10_000.0, {"rope_type": "linear", "factor": 8.0})
    assert cfg.qk_norm and cfg.attn_softcap == 0 and cfg.final_softcap == 0 and cfg.tie_word_embeddings


@pytest.mark.parametrize("kind", FAMILIES)
def test_sharded_checkpoint_reads_as_one_file(kind, tmp_path):
    whole = save_tiny(kind, tmp_path / "whole")
    hf_model(whole).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    want = dict(HFCheckpoint(whole).iter_tensors())
    got = dict(HFCheckpoint(tmp_path / "sharded").iter_tensors())
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
