"""OPT (Zhang et al. 2022): every published size, learned positions, pre- or post-LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.heads import split_heads
from flexgen_helm.models.linear import embedding, linear
from flexgen_helm.models.spec import LayerSpec, tensor

# (hidden, layers, heads, ffn); vocab 50272 and context 2048 for all sizes.
_SIZES = {
    "125m": (768, 12, 12, 3072),
    "350m": (1024, 24, 16, 4096),
    "1.3b": (2048, 24, 32, 8192),
    "2.7b": (2560, 32, 32, 10240),
    "6.7b": (4096, 32, 32, 16384),
    "13b": (5120, 40, 40, 20480),
    "30b": (7168, 48, 56, 28672),
    "66b": (9216, 64, 72, 36864),
    "175b": (12288, 96, 96, 49152),
}
SIZES = tuple(_SIZES)
POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


def config_for_size(size: str) -> ModelConfig:
    hidden, layers, heads, ffn = _SIZES[size]
    is_350m = size == "350m"
    return ModelConfig(
        family="opt",
        name=f"facebook/opt-{size}",
        vocab_size=50272,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_size=ffn,
        max_seq_len=2048,
        word_embed_proj_dim=512 if is_350m else hidden,
        do_layer_norm_before=not is_350m,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=1,
    )


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    return ModelConfig(
        family="opt",
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_attention_heads"],
        ffn_size=hf["ffn_dim"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        word_embed_proj_dim=hf.get("word_embed_proj_dim") or hf["hidden_size"],
        do_layer_norm_before=hf.get("do_layer_norm_before", True),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


def _has_final_norm(cfg: ModelConfig) -> bool:
    return cfg.do_layer_norm_before


def _projects(cfg: ModelConfig) -> bool:
    return cfg.word_embed_proj_dim != cfg.hidden_size


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    h, e, f = cfg.hidden_size, cfg.word_embed_proj_dim, cfg.ffn_size
    embed = [
        tensor("embed", "tokens.weight", cfg.vocab_size, e),
        tensor("embed", "positions.weight", cfg.max_seq_len + POSITION_OFFSET, h),
    ]
    if _projects(cfg):
        embed.append(tensor("embed", "project_in.weight", h, e))
    layers = [LayerSpec("embed", "embed", -1, tuple(embed))]
    for i in range(cfg.num_layers):
        n = f"layers.{i}"
        layers.append(LayerSpec(n, "block", i, (
            tensor(n, "attn_norm.weight", h), tensor(n, "attn_norm.bias", h),
            tensor(n, "q_proj.weight", h, h), tensor(n, "q_proj.bias", h),
            tensor(n, "k_proj.weight", h, h), tensor(n, "k_proj.bias", h),
            tensor(n, "v_proj.weight", h, h), tensor(n, "v_proj.bias", h),
            tensor(n, "o_proj.weight", h, h), tensor(n, "o_proj.bias", h),
            tensor(n, "mlp_norm.weight", h), tensor(n, "mlp_norm.bias", h),
            tensor(n, "fc1.weight", f, h), tensor(n, "fc1.bias", f),
            tensor(n, "fc2.weight", h, f), tensor(n, "fc2.bias", h),
        )))
    head = []
    if _has_final_norm(cfg):
        head += [tensor("head", "norm.weight", h), tensor("head", "norm.bias", h)]
    if _projects(cfg):
        head.append(tensor("head", "project_out.weight", e, h))
    if cfg.tie_word_embeddings:
        head.append(tensor("head", "lm_head.weight", cfg.vocab_size, e, tied_to="embed.tokens.weight"))
    else:
        head.append(tensor("head", "lm_head.weight", cfg.vocab_size, e))
    layers.append(LayerSpec("head", "head", -1, tuple(head)))
    return layers


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = embedding(ids, w["tokens.weight"])
    if _projects(cfg):
        x = linear(x, w["project_in.weight"])
    return x + embedding(positions + POSITION_OFFSET, w["positions.weight"])


def _norm(cfg, w, prefix, x):
    return F.layer_norm(x, (cfg.hidden_size,), w[f"{prefix}.weight"], w[f"{prefix}.bias"])


def run_constants(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
    """None: learned positions are weights of the embedding layer."""
    return None


def step_constants(constants: None, positions: torch.Tensor) -> None:
    """None: positions enter at the embedding."""
    return None


def qkv(cfg: ModelConfig, w: dict, h: torch.Tensor, at: None, block: int):
    x = _norm(cfg, w, "attn_norm", h) if cfg.do_layer_norm_before else h
    q = linear(x, w["q_proj.weight"], w["q_proj.bias"])
    k = linear(x, w["k_proj.weight"], w["k_proj.bias"])
    v = linear(x, w["v_proj.weight"], w["v_proj.bias"])
    n = cfg.num_heads
    return split_heads(q, n), split_heads(k, n), split_heads(v, n)


def finish_block(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    h = h + linear(attn, w["o_proj.weight"], w["o_proj.bias"])
    if not cfg.do_layer_norm_before:
        h = _norm(cfg, w, "attn_norm", h)
    x = _norm(cfg, w, "mlp_norm", h) if cfg.do_layer_norm_before else h
    x = linear(F.relu(linear(x, w["fc1.weight"], w["fc1.bias"])), w["fc2.weight"], w["fc2.bias"])
    h = h + x
    if not cfg.do_layer_norm_before:
        h = _norm(cfg, w, "mlp_norm", h)
    return h


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    if _has_final_norm(cfg):
        h = _norm(cfg, w, "norm", h)
    if _projects(cfg):
        h = linear(h, w["project_out.weight"])
    return linear(h, w["lm_head.weight"])
