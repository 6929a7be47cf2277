"""GGUF files of every family we read, written from small random checkpoints the way
llama.cpp's convert_hf_to_gguf.py writes them (its architecture names, tensor names,
metadata keys, Q/K row permutation of "llama", 1 + w norms of Gemma, Phi-3's LongRoPE
factors as tensors), read back equal to the safetensors checkpoint; unknown architectures
keep their clear error."""

from __future__ import annotations

import gc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import mappings_of, save_tiny
from safetensors.torch import load_file

from flexgen_helm.engine import Engine
from flexgen_helm.errors import ModelNotFoundError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.models.tokenizer import import_transformers
from flexgen_helm.policy import Policy, Split
from flexgen_helm.weights.gguf_file import GGUFFile
from flexgen_helm.weights.hf_checkpoint import HFCheckpoint

KINDS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
         "phi3": "phi3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
         "olmoe": "olmoe"}  # our tiny checkpoint -> llama.cpp architecture
# llama.cpp's "llama" keeps no sliding window: a Mixtral without one
OVERRIDES = {"mixtral": {"sliding_window": None}}
PROMPTS = [[5, 17, 3, 44, 9, 21, 8, 2, 60], [12, 7], [30, 31, 32, 33, 34]]
CPU32 = dict(dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices (see test_model_families)
    yield
    torch.set_num_threads(threads)


# ---- a small convert_hf_to_gguf.py: what llama.cpp writes for these architectures ----

_TENSOR = {  # HF name inside "model." (or lm_head) -> GGUF name, as gguf's tensor_mapping maps them
    "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# each projection of a block's experts, stacked: Mixtral's (w1, w3, w2) and the others'
_EXPERTS = {"block_sparse_moe.experts.{e}.w1": "ffn_gate_exps", "block_sparse_moe.experts.{e}.w3": "ffn_up_exps",
            "block_sparse_moe.experts.{e}.w2": "ffn_down_exps", "mlp.experts.{e}.gate_proj": "ffn_gate_exps",
            "mlp.experts.{e}.up_proj": "ffn_up_exps", "mlp.experts.{e}.down_proj": "ffn_down_exps"}


def _gguf_name(hf_name: str, arch: str) -> str:
    name = hf_name.removeprefix("model.").removesuffix(".weight").removesuffix(".bias")
    suffix = hf_name[len("model.") + len(name):] if hf_name.startswith("model.") else hf_name[len(name):]
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        if rest == "post_attention_layernorm":  # the MLP's norm, but Gemma's attention output norm
            part = "post_attention_norm" if arch.startswith("gemma") else "ffn_norm"
        else:
            part = _TENSOR[rest]
        return f"blk.{i}.{part}{suffix}"
    return _TENSOR[name] + suffix


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's `permute` of "llama" Q and K rows: per head, (2, pair) -> (pair, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt, out, arch: str):
    hf = HFCheckpoint(ckpt)  # for the config.json only
    raw = __import__("json").loads((ckpt / "config.json").read_text())
    cfg = hf.config
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.ffn_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch in ("qwen3", "gemma2", "gemma3", "qwen3moe"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe"):
        w.add_rope_freq_base(cfg.rope_theta)
    if arch.startswith("gemma") and raw["query_pre_attn_scalar"] != cfg.head_dim:
        # llama.cpp writes no query_pre_attn_scalar (real Gemmas follow its rule: head_dim, or
        # hidden / heads for the 27Bs); ours differs, so the key llama.cpp defines for a scale
        w.add_attention_scale(raw["query_pre_attn_scalar"] ** -0.5)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
        w.add_final_logit_softcapping(raw["final_logit_softcapping"])
        w.add_sliding_window(raw["sliding_window"])
    if arch == "gemma3":
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_sliding_window(raw["sliding_window"])
        # llama.cpp hard-codes 10000 and a pattern of 6; our tiny model has others: the keys it defines for them
        w.add_rope_freq_base_swa(cfg.local_rope_theta)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in raw["layer_types"]])
        scaling = cfg.rope_scaling_dict
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(raw["original_max_position_embeddings"])
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_sliding_window(raw.get("sliding_window") or 0)
        scaling = cfg.rope_scaling_dict
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(raw["max_position_embeddings"] / 16) / np.log(16))))
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.experts_per_token)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg.expert_ffn_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_ffn_size)
    if raw.get("clip_qkv"):
        w.add_clamp_kqv(raw["clip_qkv"])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    state = {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(f).items()}
    state = _stack_experts(state, cfg.num_experts)
    for hf_name, t in state.items():
        if hf_name.startswith("blk."):  # stacked experts, named already
            w.add_tensor(hf_name, t.float().numpy())
            continue
        if arch.startswith("gemma") and hf_name == "lm_head.weight":
            continue  # llama.cpp skips Gemma's (tied) lm_head
        name = _gguf_name(hf_name, arch)
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            t = _permute(t, cfg.num_heads if name.split(".")[-2] == "attn_q" else cfg.num_kv_heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's (1 + w)
        w.add_tensor(name, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _stack_experts(state: dict, experts: int) -> dict:
    """Each block's per-expert projections as llama.cpp's (experts, out, in) tensors."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    blocks = {int(k.split(".")[2]) for k in state if ".experts." in k}
    for i in sorted(blocks):
        for hf, name in _EXPERTS.items():
            parts = [state.get(f"model.layers.{i}.{hf.format(e=e)}.weight") for e in range(experts)]
            if parts[0] is not None:
                out[f"blk.{i}.{name}.weight"] = torch.stack(parts)
    return out


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    ckpt = save_tiny(kind, root / "hf", **OVERRIDES.get(kind, {}))
    return kind, ckpt, write_gguf(ckpt, root / f"tiny-{kind}.gguf", KINDS[kind])


_ARCHITECTURE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size",
                        "head_dim", "rope_theta", "rotary_dims", "tie_word_embeddings", "attention_bias", "qk_norm",
                        "mlp_activation", "sliding_windows", "query_scale", "attn_softcap", "final_softcap",
                        "local_rope_theta", "max_seq_len", "num_experts", "experts_per_token", "expert_ffn_size",
                        "norm_topk_prob", "routing_in_float")


def test_gguf_reads_back_the_checkpoint(pair, tmp_path):
    kind, ckpt, path = pair
    ours, reference = GGUFFile(path, cache_dir=tmp_path), HFCheckpoint(ckpt)
    for f in _ARCHITECTURE_FIELDS:
        assert getattr(ours.config, f) == pytest.approx(getattr(reference.config, f)), f
    scaling, want = ours.config.rope_scaling_dict, reference.config.rope_scaling_dict
    for key in ("rope_type", "factor", "long_factor", "short_factor"):
        assert scaling.get(key) == pytest.approx(want.get(key)), key
    want_tensors = dict(reference.iter_tensors())
    for name, t in ours.iter_tensors():
        # Gemma's norms went through 1 + w and back: float32 rounding of the sum, nothing else
        tol = 1e-6 if kind.startswith("gemma") and name.endswith("norm.weight") else 0.0
        torch.testing.assert_close(t, want_tensors[name], rtol=0, atol=tol, msg=name)


def test_gguf_runs_as_the_checkpoint(pair, tmp_path):
    kind, ckpt, path = pair
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0.3, 0.3, 0.4), cache=Split(0.3, 0.3, 0.4),
                    cpu_cache_compute=True)
    ours = Engine.load(str(path), policy, offload_dir=tmp_path / "g", **CPU32)
    reference = Engine.load(str(ckpt), policy, offload_dir=tmp_path / "h", **CPU32)
    if Path("/proc/self/maps").exists():  # the stores are written: no source file stays mapped (in RSS)
        gc.collect()
        files = [path, *Path(ckpt).glob("*.safetensors")]
        assert {f.name: mappings_of(f) for f in files} == {f.name: 0 for f in files}
    for got, want in zip(ours.score(PROMPTS).results, reference.score(PROMPTS).results):
        assert got.logprobs[1:] == pytest.approx(want.logprobs[1:], abs=1e-5)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert [r.completions[0].token_ids for r in ours.generate(PROMPTS, params).results] == \
        [r.completions[0].token_ids for r in reference.generate(PROMPTS, params).results]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_a_released_gguf_is_no_longer_mapped(pair, tmp_path):
    # a mapped file's pages count in RSS for as long as the mapping lives; a later read maps it
    # again (a tiny file: reopening SmolLM2's bundled one took 4 s a read)
    _, _, path = pair
    source = GGUFFile(path, cache_dir=tmp_path)
    source.release()  # opening parsed the file
    gc.collect()
    assert mappings_of(path) == 0
    first = source.read("layers.0.q_proj.weight")
    assert mappings_of(path) > 0
    source.release()
    gc.collect()
    assert mappings_of(path) == 0
    assert torch.equal(source.read("layers.0.q_proj.weight"), first)


def test_transformers_reads_our_gemma3_gguf_as_we_do(tmp_path):
    """An independent reader of the file written above: transformers' own GGUF loader
    (which undoes llama.cpp's Gemma norm offset itself) gives the same tensors."""
    tf = import_transformers()
    ckpt = save_tiny("gemma3", tmp_path / "hf")
    path = write_gguf(ckpt, tmp_path / "g.gguf", "gemma3")
    theirs = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ours = dict(GGUFFile(path, cache_dir=tmp_path).iter_tensors())
    torch.testing.assert_close(ours["layers.1.post_attn_norm.weight"],
                               theirs.model.layers[1].post_attention_layernorm.weight.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["layers.0.q_proj.weight"], theirs.model.layers[0].self_attn.q_proj.weight.detach())


def test_unknown_gguf_architecture_names_the_supported_ones(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelNotFoundError, match=r"architecture 'mamba' is not supported \(supported: llama, qwen2, "
                                                 r"qwen3, gemma2, gemma3, phi3, qwen2moe, qwen3moe, olmoe\)"):
        GGUFFile(tmp_path / "m.gguf", cache_dir=tmp_path)
