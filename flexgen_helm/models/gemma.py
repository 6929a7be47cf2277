"""Gemma 2 and Gemma 3 (text).

Against the Llama family: embeddings scaled by sqrt(hidden); RMSNorms of (1 + weight);
norms before and after both attention and the MLP; GeGLU (tanh GELU); scores scaled by
query_pre_attn_scalar ** -0.5 instead of head_dim's; local sliding-window blocks between
global ones (Gemma 2 every other block, Gemma 3 five of every six); Gemma 2 soft-caps
attention scores and logits (cap * tanh(x / cap)); Gemma 3 normalises each head's query
and key and rotates its local blocks with their own base (10000), unscaled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.gated_mlp import gated_mlp
from flexgen_helm.models.hf_config import as_pairs, first, rope_from_hf, sliding_windows
from flexgen_helm.models.linear import embedding, linear
from flexgen_helm.models.llama import attention_tensors, mlp_tensors, project_heads, stacked_layers
from flexgen_helm.models.norms import rms_norm_plus_one
from flexgen_helm.models.rotary import Rotary, RotaryAt, rope_type, rotary_for
from flexgen_helm.models.spec import LayerSpec, tensor

GEMMA3_TYPES = ("gemma3_text", "gemma3")


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    """Gemma 2 ("gemma2"), Gemma 3 text ("gemma3_text"), or the text half of a multimodal
    Gemma 3 ("gemma3": its text_config). Defaults are transformers' config classes' own."""
    model_type = hf.get("model_type", "gemma2")
    if model_type == "gemma3":
        hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf.get("text_config", {})}
    v3 = model_type in GEMMA3_TYPES
    n = hf.get("num_hidden_layers", 26)
    if v3:
        theta, scaling = rope_from_hf(hf, "full_attention", default_theta=1_000_000.0)
        local_theta, _ = rope_from_hf(hf, "sliding_attention", 10_000.0, "rope_local_base_freq", use_scaling=False)
        pattern = hf.get("sliding_window_pattern", 6)
        slides = lambda i: (i + 1) % pattern != 0  # noqa: E731
    else:
        (theta, scaling), local_theta = rope_from_hf(hf), 0.0
        slides = lambda i: i % 2 == 0  # noqa: E731
    heads = hf.get("num_attention_heads", 8)
    cfg = ModelConfig(
        family="gemma",
        name=name,
        vocab_size=hf.get("vocab_size", 262_208 if v3 else 256_000),
        hidden_size=hf.get("hidden_size", 2304),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_size=hf.get("intermediate_size", 9216),
        max_seq_len=hf.get("max_position_embeddings", 131_072 if v3 else 8192),
        head_dim=hf.get("head_dim") or 256,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=as_pairs(scaling),
        local_rope_theta=local_theta,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        attention_bias=hf.get("attention_bias", False),
        qk_norm=v3,
        mlp_activation="gelu_tanh",
        sliding_windows=sliding_windows(hf, n, hf.get("sliding_window", 4096), slides),
        query_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping", None if v3 else 50.0) or 0.0,
        final_softcap=hf.get("final_logit_softcapping", None if v3 else 30.0) or 0.0,
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=first(hf.get("eos_token_id", 1)),
        pad_token_id=hf.get("pad_token_id", 0),
    )
    rope_type(cfg)
    return cfg


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    h = cfg.hidden_size
    return stacked_layers(cfg, lambda n: [
        tensor(n, "attn_norm.weight", h), *attention_tensors(cfg, n), tensor(n, "post_attn_norm.weight", h),
        tensor(n, "mlp_norm.weight", h), *mlp_tensors(cfg, n), tensor(n, "post_mlp_norm.weight", h)])


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = embedding(ids, w["tokens.weight"])
    return x * torch.tensor(cfg.hidden_size ** 0.5, dtype=x.dtype)  # the scale rounded to x's dtype, as Gemma's


@dataclass(frozen=True)
class GemmaRotaries:
    """The run's rotary tables: global blocks' and local (sliding-window) blocks'."""

    full: Rotary
    local: Rotary

    def at(self, positions: torch.Tensor) -> "GemmaRotariesAt":
        local = self.local.at(positions) if self.local is not self.full else None
        return GemmaRotariesAt(self.full.at(positions), local)


@dataclass(frozen=True)
class GemmaRotariesAt:
    """Both rotations at one step's positions (local None: the global one serves both)."""

    full: RotaryAt
    local: RotaryAt | None

    def of(self, cfg: ModelConfig, block: int) -> RotaryAt:
        return self.local if cfg.window(block) and self.local is not None else self.full


def run_constants(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> GemmaRotaries:
    full = rotary_for(cfg, max_len, device, dtype)
    local = rotary_for(cfg, max_len, device, dtype, theta=cfg.local_rope_theta, scaling={}) \
        if cfg.local_rope_theta else full
    return GemmaRotaries(full, local)


def step_constants(rotaries: GemmaRotaries, positions: torch.Tensor) -> GemmaRotariesAt:
    return rotaries.at(positions)


def qkv(cfg: ModelConfig, w: dict, h: torch.Tensor, at: GemmaRotariesAt, block: int):
    x = rms_norm_plus_one(h, w["attn_norm.weight"], cfg.rms_norm_eps)
    q, k, v = project_heads(cfg, w, x, rms_norm_plus_one)
    rotary = at.of(cfg, block)
    q, k = rotary.apply(q), rotary.apply(k)
    # attention scales scores by 1 / sqrt(head_dim): the query carries the rest of Gemma's scale
    rescale = cfg.query_scale * math.sqrt(cfg.head_dim)
    return (q if rescale == 1.0 else q * rescale), k, v


def finish_block(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    eps = cfg.rms_norm_eps
    h = h + rms_norm_plus_one(linear(attn, w["o_proj.weight"]), w["post_attn_norm.weight"], eps)
    x = rms_norm_plus_one(h, w["mlp_norm.weight"], eps)
    x = gated_mlp(x, w["gate_proj.weight"], w["up_proj.weight"], w["down_proj.weight"], cfg.mlp_activation)
    return h + rms_norm_plus_one(x, w["post_mlp_norm.weight"], eps)


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    logits = linear(rms_norm_plus_one(h, w["norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"])
    if cfg.final_softcap:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits
