"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

RMSNorm, rotary position embeddings (with the checkpoint's theta and scaling), SwiGLU,
grouped-query attention, tied or untied embeddings, optional q/k/v biases (Qwen2), an
RMSNorm over each head's query and key (Qwen3), sliding-window blocks (Mistral v0.1,
Qwen with use_sliding_window).
"""

from __future__ import annotations

from typing import Callable

import torch

from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.gated_mlp import gated_mlp
from flexgen_helm.models.heads import split_heads
from flexgen_helm.models.hf_config import as_pairs, first, rope_from_hf, sliding_windows
from flexgen_helm.models.linear import embedding, linear
from flexgen_helm.models.norms import rms_norm
from flexgen_helm.models.rotary import Rotary, RotaryAt, rope_type, rotary_for
from flexgen_helm.models.spec import LayerSpec, tensor

# Qwen's configs keep a sliding_window that transformers applies only with use_sliding_window
QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _slides(hf: dict, model_type: str):
    """transformers' rule for which blocks use the sliding window when the config does not
    list layer_types: Mistral (and Mixtral) all of them, Qwen those from max_window_layers on."""
    if model_type in ("mistral", "mixtral"):
        return lambda i: True
    if model_type in QWEN_TYPES and hf.get("use_sliding_window"):
        return lambda i: i >= hf.get("max_window_layers", 28)
    return lambda i: False


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    heads = hf["num_attention_heads"]
    model_type = hf.get("model_type", "llama")
    theta, scaling = rope_from_hf(hf)
    window = hf.get("sliding_window")
    if model_type in QWEN_TYPES and not hf.get("use_sliding_window"):
        window = None  # transformers ignores Qwen's sliding_window unless use_sliding_window
    cfg = ModelConfig(
        family="llama",
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_size=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=as_pairs(scaling),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", model_type == "qwen2"),
        qk_norm=model_type == "qwen3",
        sliding_windows=sliding_windows(hf, hf["num_hidden_layers"], window, _slides(hf, model_type)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )
    rope_type(cfg)  # fail early on an unsupported scaling
    return cfg


def attention_tensors(cfg: ModelConfig, n: str) -> list:
    """q, k, v (with their biases where the checkpoint has them), the per-head q/k norms
    where it has them, o: the attention tensors of the Llama and Gemma families."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    ts = [tensor(n, "q_proj.weight", q_out, h), tensor(n, "k_proj.weight", kv_out, h),
          tensor(n, "v_proj.weight", kv_out, h)]
    if cfg.attention_bias:
        ts += [tensor(n, "q_proj.bias", q_out), tensor(n, "k_proj.bias", kv_out), tensor(n, "v_proj.bias", kv_out)]
    if cfg.qk_norm:
        ts += [tensor(n, "q_norm.weight", d), tensor(n, "k_norm.weight", d)]
    return ts + [tensor(n, "o_proj.weight", h, q_out)]


def mlp_tensors(cfg: ModelConfig, n: str) -> list:
    h, f = cfg.hidden_size, cfg.ffn_size
    return [tensor(n, "gate_proj.weight", f, h), tensor(n, "up_proj.weight", f, h), tensor(n, "down_proj.weight", h, f)]


def stacked_layers(cfg: ModelConfig, block_tensors: Callable[[str], list]) -> list[LayerSpec]:
    """The embedding, cfg.num_layers blocks (`block_tensors(prefix)` each: "layers.{i}"),
    the final norm and lm_head (tied to the embedding where the checkpoint ties them): the
    layers of the Llama, Gemma and Phi-3 families."""
    h, tied = cfg.hidden_size, "embed.tokens.weight" if cfg.tie_word_embeddings else None
    blocks = [LayerSpec(f"layers.{i}", "block", i, tuple(block_tensors(f"layers.{i}"))) for i in range(cfg.num_layers)]
    return [LayerSpec("embed", "embed", -1, (tensor("embed", "tokens.weight", cfg.vocab_size, h),)), *blocks,
            LayerSpec("head", "head", -1, (tensor("head", "norm.weight", h),
                                           tensor("head", "lm_head.weight", cfg.vocab_size, h, tied_to=tied)))]


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    h = cfg.hidden_size
    return stacked_layers(cfg, lambda n: [tensor(n, "attn_norm.weight", h), *attention_tensors(cfg, n),
                                          tensor(n, "mlp_norm.weight", h), *mlp_tensors(cfg, n)])


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return embedding(ids, w["tokens.weight"])


def run_constants(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> Rotary:
    return rotary_for(cfg, max_len, device, dtype)


def project_heads(cfg: ModelConfig, w: dict, x: torch.Tensor, norm) -> tuple[torch.Tensor, ...]:
    """q, k, v heads of the normalised input x; `norm(heads, weight, eps)` normalises each
    head's query and key where the family has those norms (Qwen3, Gemma 3)."""
    q = split_heads(linear(x, w["q_proj.weight"], w.get("q_proj.bias")), cfg.num_heads)
    k = split_heads(linear(x, w["k_proj.weight"], w.get("k_proj.bias")), cfg.num_kv_heads)
    v = split_heads(linear(x, w["v_proj.weight"], w.get("v_proj.bias")), cfg.num_kv_heads)
    if cfg.qk_norm:
        q, k = norm(q, w["q_norm.weight"], cfg.rms_norm_eps), norm(k, w["k_norm.weight"], cfg.rms_norm_eps)
    return q, k, v


def step_constants(rotary: Rotary, positions: torch.Tensor) -> RotaryAt:
    """What qkv needs at (b, s) positions, shared by every layer of the step."""
    return rotary.at(positions)


def qkv(cfg: ModelConfig, w: dict, h: torch.Tensor, at: RotaryAt, block: int):
    """at: step_constants of the positions of h."""
    q, k, v = project_heads(cfg, w, rms_norm(h, w["attn_norm.weight"], cfg.rms_norm_eps), rms_norm)
    return at.apply(q), at.apply(k), v


def finish_block(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    h = h + linear(attn, w["o_proj.weight"])
    x = rms_norm(h, w["mlp_norm.weight"], cfg.rms_norm_eps)
    return h + gated_mlp(x, w["gate_proj.weight"], w["up_proj.weight"], w["down_proj.weight"], cfg.mlp_activation)


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    return linear(rms_norm(h, w["norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"])
