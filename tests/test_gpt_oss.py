"""gpt-oss beyond the family tests (tests/test_model_families.py: transformers' tokens and
log-probs under four policies, 4-bit weights, sharded files): its config mapping, YaRN's
tables against transformers', attention sinks on every attention path (and that they
matter), MXFP4 experts dequantized exactly, and what is refused: sparse attention, a
checkpoint missing a sink, router or expert tensor (or an MXFP4 scale), MXFP4 elsewhere."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import caches_holding_a_prefix, engine_device, hf_model, save_tiny
from safetensors.torch import load_file, save_file

from flexgen_helm.engine import Engine
from flexgen_helm.errors import PolicyError, WeightStoreError
from flexgen_helm.executor.attention import (
    DecodePrefix,
    attend,
    attend_as_decode,
    attend_past_held_prefix,
    attend_past_shared_prefix,
    unit_sinks,
)
from flexgen_helm.models.moe import config_from_hf
from flexgen_helm.models.rotary import inverse_frequencies
from flexgen_helm.policy import Policy
from flexgen_helm.weights.hf_checkpoint import HFCheckpoint

F32 = dict(dtype="float32", device=engine_device(), progress=False)
PROMPTS = [[5, 17, 3, 44, 9, 21, 8, 2, 60], [12, 7], [30, 31, 32, 33, 34, 35, 36]]
HF = {"model_type": "gpt_oss", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16,
      "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    return save_tiny("gpt_oss", tmp_path_factory.mktemp("tiny-gpt-oss"))


def test_config_maps_windows_yarn_biases_and_token_ids():
    cfg = config_from_hf({**HF, "sliding_window": 16, "eos_token_id": [7, 8], "pad_token_id": 9,
                          "rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0,
                                              "beta_fast": 16.0, "beta_slow": 1.0, "truncate": False,
                                              "original_max_position_embeddings": 32}}, "g")
    assert (cfg.family, cfg.moe_type, cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size) == (
        "moe", "gpt_oss", 4, 2, 16)
    assert cfg.sliding_windows == (16, 0, 16, 0)  # transformers' default layer_types: every even block slides
    assert cfg.rope_theta == 500.0 and cfg.rope_scaling_dict["rope_type"] == "yarn"
    assert cfg.attention_bias and cfg.output_bias and cfg.attention_sinks and cfg.mlp_bias and cfg.softmax_after_topk
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.tie_word_embeddings) == (7, 9, False)
    listed = config_from_hf({**HF, "sliding_window": 16,
                             "layer_types": ["full_attention", "sliding_attention"] * 2}, "g")
    assert listed.sliding_windows == (0, 16, 0, 16)
    # a config with no rotary fields at all: GptOssConfig's defaults (theta 150000, YaRN x32 over 4096)
    bare = config_from_hf(HF, "g")
    assert bare.rope_theta == 150000.0 and bare.rope_scaling_dict["factor"] == 32.0
    assert bare.sliding_windows == (128, 0, 128, 0)


@pytest.mark.parametrize("rope", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "original_max_position_embeddings": 16},  # truncated
    {"factor": 8.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
    {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
])
def test_yarn_tables_are_transformers(rope):
    from flexgen_helm.models.tokenizer import import_transformers

    tf = import_transformers()  # (hides a broken torchvision from it first)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **rope}
    hf = {**HF, "head_dim": 64, "rope_parameters": params}
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](tf.GptOssConfig(**hf))
    inv, factor = inverse_frequencies(config_from_hf(hf, "g"), 256)
    assert torch.equal(inv, want_inv.float())
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert factor != 1.0 or "attention_factor" in rope


def _sinks(u: int, r: int) -> torch.Tensor:
    return torch.randn(u, r) * 2


def _reference(q, k, v, allowed, sinks):
    """transformers' eager attention with sinks: the sink column appended to each softmax."""
    scores = torch.matmul(q, k.transpose(1, 2)[:, None]) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], -math.inf)
    sink = sinks[:, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.matmul(weights, v[:, None])


@pytest.mark.parametrize("window", [0, 3])
def test_prompt_and_decode_attention_apply_the_sinks(window):
    torch.manual_seed(0)
    u, r, t, d = 4, 2, 7, 8
    q, k, v, sinks = torch.randn(u, r, t, d), torch.randn(u, t, d), torch.randn(u, t, d), _sinks(u, r)
    lengths = torch.tensor([7, 5, 2, 6])
    valid = torch.arange(t)[None, :] >= t - lengths[:, None]  # left padding
    pos = torch.arange(t)
    causal = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
    allowed = valid[:, None, :] & causal[None]
    want = _reference(q, k, v, allowed, sinks)
    got = attend(q, k, v, valid, causal=True, window=window, sinks=sinks)
    real = valid[:, None, :, None].expand_as(want)  # padding queries: nobody reads them
    assert torch.allclose(got[real], want[real], atol=1e-6)
    same_stored = attend_as_decode(q, k, v, valid, lambda k_, v_: (k_, v_), window=window, sinks=sinks)
    assert torch.allclose(same_stored[real], want[real], atol=1e-6)
    # a decode step: the last query over the keys it may see
    seen = allowed[:, -1]
    step = attend(q[:, :, -1:], k, v, seen, causal=False, sinks=sinks)
    assert torch.allclose(step, want[:, :, -1:], atol=1e-6)
    assert not torch.allclose(step, attend(q[:, :, -1:], k, v, seen, causal=False), atol=1e-3)  # they matter


def test_shared_and_held_prefix_attention_apply_the_sinks_once_to_the_merged_softmax():
    q, k, v, valid, prefix_k, prefix_v, starts = caches_holding_a_prefix(1)
    (kvh, n, _), r = prefix_k.shape, q.shape[1]
    sequences, t = len(starts), k.shape[1]
    sinks = unit_sinks(torch.randn(kvh * r) * 2, kvh, 0, sequences * kvh)
    want = attend(q, k, v, valid, causal=False, sinks=sinks)
    positions = torch.arange(t)[None, :]
    unit_starts = starts[torch.arange(sequences * kvh) // kvh][:, None]
    own = valid & ((positions < unit_starts) | (positions >= unit_starts + n))
    got = attend_past_shared_prefix(q, k, v, own, DecodePrefix(prefix_k, prefix_v), sinks=sinks)
    assert torch.allclose(got, want, atol=1e-6)
    held = attend_past_held_prefix(q, k, v, own, prefix_k, prefix_v, sinks=sinks)
    assert torch.allclose(held, want, atol=1e-6)


def test_unit_sinks_follow_the_units_key_value_heads():
    sinks = torch.arange(6.0)  # 6 query heads over 2 kv heads: heads 0-2 read kv head 0
    assert unit_sinks(sinks, 2, 1, 3).tolist() == [[3.0, 4.0, 5.0], [0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file(edit(load_file(f)), f, metadata={"format": "pt"})
    return dst


def test_the_sinks_matter(tiny_gpt_oss, tmp_path):
    """The engine with the checkpoint's sinks zeroed is far from transformers with them (and
    the family tests find it equal with them): a model that ignored its sinks would fail."""
    model = hf_model(tiny_gpt_oss)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([PROMPTS[0]])).logits[0], -1)
    want = [float(want[i - 1, PROMPTS[0][i]]) for i in range(1, len(PROMPTS[0]))]
    zeroed = _edited(tiny_gpt_oss, tmp_path / "zeroed",
                     lambda s: {k: torch.zeros_like(t) if k.endswith("sinks") else t for k, t in s.items()})
    got = Engine.load(str(zeroed), Policy(gpu_batch_size=1), offload_dir=tmp_path, **F32).score(PROMPTS[:1])
    assert max(abs(a - b) for a, b in zip(got.results[0].logprobs[1:], want)) > 1e-2


def test_sparse_attention_is_refused_before_any_work(tiny_gpt_oss, tmp_path):
    with pytest.raises(PolicyError, match="attention sinks"):
        Engine.load(str(tiny_gpt_oss), Policy(gpu_batch_size=2, attn_sparsity=0.5), offload_dir=tmp_path, **F32)
    assert not list(tmp_path.iterdir())  # nothing converted, nothing offloaded


def _mxfp4_pair(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 (as OpenAI published gpt-oss: *_blocks and
    *_scales, quantization_config mxfp4; random codes, scales near 2 ** 0), and the same model
    with those experts as transformers dequantizes them (convert_moe_packed_tensors)."""
    from flexgen_helm.models.tokenizer import import_transformers

    import_transformers()  # (hides a broken torchvision from it first)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = save_tiny("gpt_oss", tmp_path / "src", hidden_size=64)  # MXFP4 groups of 32 along hidden and ffn
    torch.manual_seed(1)
    packed = {}

    def as_mxfp4(state):
        out = dict(state)
        for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            e, d_in, d_out = state.pop(name).shape
            blocks = torch.randint(0, 256, (e, d_out, d_in // 32, 16), dtype=torch.uint8)
            scales = torch.randint(123, 128, (e, d_out, d_in // 32), dtype=torch.uint8)
            del out[name]
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            packed[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        return out

    quantized = _edited(src, tmp_path / "mxfp4", as_mxfp4)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))
    plain = _edited(src, tmp_path / "plain", lambda state: {**state, **packed})
    return quantized, plain


def test_mxfp4_experts_are_dequantized_exactly_at_conversion(tmp_path):
    quantized, plain = _mxfp4_pair(tmp_path)
    got, want = HFCheckpoint(quantized), HFCheckpoint(plain)
    assert got.mxfp4 and not want.mxfp4
    want_tensors = dict(want.iter_tensors())
    for name, t in got.iter_tensors():
        assert torch.equal(t, want_tensors.pop(name)), name
    assert not want_tensors
    model = hf_model(plain)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPTS[0]])).logits[0], -1)
    engine = Engine.load(str(quantized), Policy(gpu_batch_size=1), offload_dir=tmp_path / "off", **F32)
    assert engine.score(PROMPTS[:1]).results[0].logprobs[1:] == pytest.approx(
        [float(lp[i - 1, PROMPTS[0][i]]) for i in range(1, len(PROMPTS[0]))], abs=1e-4)


def test_mxfp4_with_missing_scales_or_on_another_family_is_refused(tmp_path, tiny_gpt_oss):
    quantized, _ = _mxfp4_pair(tmp_path)
    f = quantized / "model.safetensors"
    save_file({k: t for k, t in load_file(f).items() if not k.endswith("layers.2.mlp.experts.down_proj_scales")}, f,
              metadata={"format": "pt"})
    with pytest.raises(WeightStoreError, match=r"'model\.layers\.2\.mlp\.experts\.down_proj_scales'.*not found in"):
        HFCheckpoint(quantized)
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": {
        "quant_method": "mxfp4"}}))
    with pytest.raises(WeightStoreError, match="MXFP4.*gpt-oss's experts only.*'qwen3'"):
        HFCheckpoint(other)


@pytest.mark.parametrize("missing", ["layers.1.self_attn.sinks", "layers.2.mlp.router.bias",
                                     "layers.0.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj_bias"])
def test_a_missing_sink_router_or_expert_tensor_is_named_with_its_file(tiny_gpt_oss, tmp_path, missing):
    path = _edited(tiny_gpt_oss, tmp_path / "m", lambda s: {k: t for k, t in s.items() if not k.endswith(missing)})
    with pytest.raises(WeightStoreError, match=rf"'model\.{missing}'.*not found in model\.safetensors"):
        HFCheckpoint(path)


def test_misshapen_fused_experts_are_named_with_their_file(tiny_gpt_oss, tmp_path):
    name = "model.layers.0.mlp.experts.gate_up_proj"
    path = _edited(tiny_gpt_oss, tmp_path / "m", lambda s: {**s, name: s[name][:, :, :-2].contiguous()})
    with pytest.raises(WeightStoreError, match=rf"model\.safetensors: tensor '{name}' has shape"):
        HFCheckpoint(path)


def test_experts_are_cut_out_of_the_fused_tensors(tiny_gpt_oss):
    """Expert e's gate and up projections are gate_up_proj[e]'s even and odd columns, (out, in)."""
    state = load_file(tiny_gpt_oss / "model.safetensors")
    ckpt = HFCheckpoint(tiny_gpt_oss)
    fused = state["model.layers.1.mlp.experts.gate_up_proj"][2]
    assert torch.equal(ckpt.read("layers.1.experts.2.gate_proj.weight"), fused[:, 0::2].T)
    assert torch.equal(ckpt.read("layers.1.experts.2.up_proj.weight"), fused[:, 1::2].T)
    assert torch.equal(ckpt.read("layers.1.experts.2.up_proj.bias"),
                       state["model.layers.1.mlp.experts.gate_up_proj_bias"][2, 1::2])
    assert torch.equal(ckpt.read("layers.1.experts.2.down_proj.weight"),
                       state["model.layers.1.mlp.experts.down_proj"][2].T)


def test_gpt_oss_20b_geometry():
    """openai/gpt-oss-20b as published (for --dummy benchmarks): 20.9B parameters."""
    from flexgen_helm.models import family_of
    from flexgen_helm.models.moe import geometry
    from flexgen_helm.models.spec import all_store_tensors

    cfg = geometry("gpt-oss-20b")
    params = sum(t.numel for t in all_store_tensors(family_of(cfg).layer_specs(cfg)))
    assert 20.8e9 < params < 21.0e9
    assert cfg.sliding_windows == (128, 0) * 12 and cfg.rope_scaling_dict["factor"] == 32.0
    assert (cfg.num_experts, cfg.experts_per_token, cfg.head_dim, cfg.eos_token_id) == (32, 4, 64, 200002)


def test_yarn_runs_in_the_llama_family_as_transformers(tmp_path):
    """YaRN is transformers' one table for every family that names it (Qwen2.5's long-context
    configs): a Qwen2 with it agrees with transformers past its pretraining context."""
    path = save_tiny("qwen2", tmp_path / "m", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 8})
    model = hf_model(path)
    prompt = list(range(3, 23))
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    got = Engine.load(str(path), Policy(gpu_batch_size=1), offload_dir=tmp_path, **F32).score([prompt])
    assert got.results[0].logprobs[1:] == pytest.approx([float(want[i - 1, prompt[i]]) for i in range(1, 20)],
                                                        abs=1e-4)
