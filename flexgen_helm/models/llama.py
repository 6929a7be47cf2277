"""The Llama family: Llama 2/3, Mistral, Qwen2, SmolLM2.

RMSNorm, rotary position embeddings (with the checkpoint's theta and scaling), SwiGLU,
grouped-query attention, tied or untied embeddings, optional q/k/v biases (Qwen2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexgen_helm.errors import FlexGenError
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.linear import embedding, linear
from flexgen_helm.models.spec import LayerSpec, tensor

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3")


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    heads = hf["num_attention_heads"]
    # transformers >= 5 writes theta and scaling together, as rope_parameters
    rope = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else {})
    model_type = hf.get("model_type", "llama")
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
        rope_scaling=tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict)))),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", model_type == "qwen2"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )
    _rope_type(cfg)  # fail early on an unsupported scaling
    return cfg


def _first(x):
    return x[0] if isinstance(x, list) else x


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    h, f, d = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    layers = [LayerSpec("embed", "embed", -1, (tensor("embed", "tokens.weight", cfg.vocab_size, h),))]
    for i in range(cfg.num_layers):
        n = f"layers.{i}"
        ts = [
            tensor(n, "attn_norm.weight", h),
            tensor(n, "q_proj.weight", q_out, h),
            tensor(n, "k_proj.weight", kv_out, h),
            tensor(n, "v_proj.weight", kv_out, h),
        ]
        if cfg.attention_bias:
            ts += [tensor(n, "q_proj.bias", q_out), tensor(n, "k_proj.bias", kv_out), tensor(n, "v_proj.bias", kv_out)]
        ts += [
            tensor(n, "o_proj.weight", h, q_out),
            tensor(n, "mlp_norm.weight", h),
            tensor(n, "gate_proj.weight", f, h),
            tensor(n, "up_proj.weight", f, h),
            tensor(n, "down_proj.weight", h, f),
        ]
        layers.append(LayerSpec(n, "block", i, tuple(ts)))
    tied = "embed.tokens.weight" if cfg.tie_word_embeddings else None
    layers.append(LayerSpec("head", "head", -1, (
        tensor("head", "norm.weight", h),
        tensor("head", "lm_head.weight", cfg.vocab_size, h, tied_to=tied),
    )))
    return layers


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return embedding(ids, w["tokens.weight"])


def _rms_norm(cfg: ModelConfig, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    return weight * xf.to(x.dtype)


def _rope_type(cfg: ModelConfig) -> str:
    scaling = cfg.rope_scaling_dict
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_SCALING:
        raise FlexGenError(
            f"{cfg.name}: rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_SCALING)})"
        )
    return kind


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind, s = _rope_type(cfg), cfg.rope_scaling_dict
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend between.
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_len / low, inv / factor, torch.where(wavelen < old_len / high, inv, blended))
    return inv.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class Rotary:
    """cos and sin of the rotation angles of every position of a run, (max_len, head_dim):
    built once per schedule (as gpt-fast's setup_caches), indexed by position at each step."""

    cos: torch.Tensor
    sin: torch.Tensor

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (b, 1, s, head_dim) cos and sin for (b, s) positions."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def step_constants(rotary: Rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What qkv needs at (b, s) positions: their cos and sin, looked up once per step and
    shared by every layer (the lookup per layer was a gather per layer and step)."""
    return rotary.at(positions)


def run_constants(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> Rotary:
    inv = inverse_frequencies(cfg).to(device)
    angles = torch.arange(max_len, device=device).float()[:, None] * inv  # (max_len, d/2)
    angles = torch.cat((angles, angles), dim=-1)
    return Rotary(angles.cos().to(dtype), angles.sin().to(dtype))


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, n, -1).transpose(1, 2)


def qkv(cfg: ModelConfig, w: dict, h: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]):
    """at: step_constants of the positions of h."""
    x = _rms_norm(cfg, w["attn_norm.weight"], h)
    q = linear(x, w["q_proj.weight"], w.get("q_proj.bias"))
    k = linear(x, w["k_proj.weight"], w.get("k_proj.bias"))
    v = linear(x, w["v_proj.weight"], w.get("v_proj.bias"))
    q, k, v = _heads(q, cfg.num_heads), _heads(k, cfg.num_kv_heads), _heads(v, cfg.num_kv_heads)
    cos, sin = at
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def finish_block(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    h = h + linear(attn, w["o_proj.weight"])
    x = _rms_norm(cfg, w["mlp_norm.weight"], h)
    x = F.silu(linear(x, w["gate_proj.weight"])) * linear(x, w["up_proj.weight"])
    return h + linear(x, w["down_proj.weight"])


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    return linear(_rms_norm(cfg, w["norm.weight"], h), w["lm_head.weight"])
