"""Phi-3 and Phi-3.5 mini (and Phi-4-mini's partial rotary).

The Llama block with two fused projections: qkv_proj (the query's rows, then the key's,
then the value's) and gate_up_proj (the gate's rows, then the up's), kept fused in the
store, as the checkpoint and llama.cpp's GGUF (attn_qkv, ffn_up) hold them, so one matmul
computes each; LongRoPE scaling for the long-context checkpoints; a sliding window on
every block where the config sets one.
"""

from __future__ import annotations

import torch

from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.gated_mlp import fused_gated_mlp
from flexgen_helm.models.heads import split_heads
from flexgen_helm.models.hf_config import as_pairs, first, partial_rotary_factor, rope_from_hf, sliding_windows
from flexgen_helm.models.linear import linear
from flexgen_helm.models.llama import embed, head, run_constants, stacked_layers, step_constants  # noqa: F401 (shared)
from flexgen_helm.models.norms import rms_norm
from flexgen_helm.models.rotary import RotaryAt, rope_type
from flexgen_helm.models.spec import LayerSpec, tensor


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, scaling = rope_from_hf(hf)
    if scaling and "original_max_position_embeddings" in hf:
        # Phi-3 keeps the pretraining context beside rope_scaling; it wins (as in transformers)
        scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    n = hf["num_hidden_layers"]
    cfg = ModelConfig(
        family="phi3",
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_size=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=as_pairs(scaling),
        rotary_dims=int(head_dim * partial_rotary_factor(hf)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        sliding_windows=sliding_windows(hf, n, hf.get("sliding_window"), lambda i: True),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )
    rope_type(cfg)
    return cfg


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    h, f, d = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    return stacked_layers(cfg, lambda n: [
        tensor(n, "attn_norm.weight", h),
        tensor(n, "qkv_proj.weight", qkv_out, h),
        tensor(n, "o_proj.weight", h, cfg.num_heads * d),
        tensor(n, "mlp_norm.weight", h),
        tensor(n, "gate_up_proj.weight", 2 * f, h),
        tensor(n, "down_proj.weight", h, f),
    ])


def qkv(cfg: ModelConfig, w: dict, h: torch.Tensor, at: RotaryAt, block: int):
    x = rms_norm(h, w["attn_norm.weight"], cfg.rms_norm_eps)
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = linear(x, w["qkv_proj.weight"]).split([q_out, kv_out, kv_out], dim=-1)
    q, k, v = split_heads(q, cfg.num_heads), split_heads(k, cfg.num_kv_heads), split_heads(v, cfg.num_kv_heads)
    return at.apply(q), at.apply(k), v


def finish_block(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    h = h + linear(attn, w["o_proj.weight"])
    x = rms_norm(h, w["mlp_norm.weight"], cfg.rms_norm_eps)
    return h + fused_gated_mlp(x, w["gate_up_proj.weight"], w["down_proj.weight"], cfg.mlp_activation)
