"""Rotary position embeddings, shared by the Llama, Gemma and Phi-3 families.

The inverse frequencies of a checkpoint's scaling (none, linear, Llama 3.1's, Phi-3's
LongRoPE, YaRN), the cos/sin tables of a run (built once per schedule, as gpt-fast's
setup_caches, and indexed per step) and the rotation of query and key heads. Heads rotate
in halves, as transformers and llama.cpp's NEOX mode do (the GGUF reader undoes the row
permutation of llama.cpp's "llama" files)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexgen_helm.errors import FlexGenError
from flexgen_helm.models import cache_pieces
from flexgen_helm.models.config import ModelConfig

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3", "longrope", "yarn")


def rope_type(cfg: ModelConfig, scaling: dict | None = None) -> str:
    """The scaling's type, checked (Phi-3's early checkpoints call LongRoPE "su")."""
    s = cfg.rope_scaling_dict if scaling is None else scaling
    kind = s.get("rope_type", s.get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in SUPPORTED_ROPE_SCALING:
        raise FlexGenError(
            f"{cfg.name}: rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_SCALING)})"
        )
    return kind


def rotary_dims(cfg: ModelConfig) -> int:
    return cfg.rotary_dims or cfg.head_dim


def inverse_frequencies(cfg: ModelConfig, max_len: int, theta: float | None = None, scaling: dict | None = None
                        ) -> tuple[torch.Tensor, float]:
    """The (rotary_dims / 2,) float32 inverse frequencies of base `theta` (default the
    checkpoint's) under `scaling` (default the checkpoint's), and the factor that cos and
    sin are multiplied by (LongRoPE's attention factor, else 1)."""
    d = rotary_dims(cfg)
    s = cfg.rope_scaling_dict if scaling is None else scaling
    inv = 1.0 / ((cfg.rope_theta if theta is None else theta) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind, factor = rope_type(cfg, s), 1.0
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend between.
        f, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / f + smooth * inv
        inv = torch.where(wavelen > old_len / low, inv / f, torch.where(wavelen < old_len / high, inv, blended))
    elif kind == "longrope":
        inv, factor = _longrope(cfg, s, inv, max_len)
    elif kind == "yarn":
        return _yarn(cfg, s, cfg.rope_theta if theta is None else theta)
    return inv.float(), factor


def _yarn(cfg: ModelConfig, s: dict, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss): each frequency blended between itself (extrapolated: the fast ones,
    past beta_fast rotations over the pretraining context) and itself / factor
    (interpolated: the slow ones, under beta_slow), linearly between; cos and sin scaled by
    the attention factor (0.1 ln(factor) + 1 unless the config gives it, or mscale's
    ratio). Computed in float32, step for step as transformers' _compute_yarn_parameters,
    so that the tables are the same to the bit."""
    d = rotary_dims(cfg)
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_seq_len / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    powers = theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolated = 1 - ramp
    inv = (1.0 / (factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated
    return inv, attention


def _longrope(cfg: ModelConfig, s: dict, inv: torch.Tensor, max_len: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its own factor, the long set when the run
    reaches past the pretraining context. Chosen once per run from its length (as llama.cpp
    chooses by its context size); transformers chooses per forward call from the longest
    position it sees, which agrees whenever a run stays on one side of that context."""
    original = s["original_max_position_embeddings"]
    factors = torch.tensor(s["long_factor"] if max_len > original else s["short_factor"], dtype=torch.float64)
    scale = s.get("factor") or cfg.max_seq_len / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    return inv / factors, attention


@dataclass(frozen=True)
class Rotary:
    """cos and sin of the rotation angles of every position of a run, (max_len, rotary_dims)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def table(cls, inv: torch.Tensor, factor: float, max_len: int, device, dtype: torch.dtype) -> "Rotary":
        angles = torch.arange(max_len, device=device).float()[:, None] * inv.to(device)  # (max_len, dims / 2)
        angles = torch.cat((angles, angles), dim=-1)
        return cls((angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype))

    def at(self, positions: torch.Tensor) -> "RotaryAt":
        """The rotation at (b, s) positions: looked up once per step and shared by every
        layer (a lookup per layer was a gather per layer and step)."""
        return RotaryAt(self.cos[positions][:, None], self.sin[positions][:, None])  # (b, 1, s, dims)


@dataclass(frozen=True)
class RotaryAt:
    """cos and sin at one step's positions, (b, 1, s, rotary_dims)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Heads x (b, n, s, head_dim) rotated; dimensions past the table's width (partial
        rotary) pass unchanged. A large x is rotated a piece of positions at a time
        (models/cache_pieces.py)."""
        out = torch.empty_like(x)
        if not cache_pieces.pieced(x.numel(), x.device.type):
            _rotate_into(out, x, self.cos, self.sin)
            return out
        step = max(1, cache_pieces.PIECE_ELEMENTS * x.shape[-2] // x.numel())
        for start in range(0, x.shape[-2], step):
            at = slice(start, start + step)
            _rotate_into(out[..., at, :], x[..., at, :], self.cos[..., at, :], self.sin[..., at, :])
        return out


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    dims = cos.shape[-1]
    half = dims // 2
    x1, x2 = x[..., :half], x[..., half:dims]
    # x * cos + rotate_half(x) * sin, half by half into one tensor: the same products and
    # sums (a + (-b) is a - b), without the rotated copy's negation and concatenation
    # (0.65x the time at a few-shot prefill's shapes, float32, 2-core Xeon, 2026-11-28)
    first, second = out[..., :half], out[..., half:dims]
    torch.mul(x1, cos[..., :half], out=first).sub_(x2 * sin[..., :half])
    torch.mul(x2, cos[..., half:], out=second).add_(x1 * sin[..., half:])
    if dims < x.shape[-1]:  # partial rotary: the rest passes unchanged
        out[..., dims:] = x[..., dims:]


def rotary_for(cfg: ModelConfig, max_len: int, device, dtype: torch.dtype, theta: float | None = None,
               scaling: dict | None = None) -> Rotary:
    """The run's table for base `theta` under `scaling` (defaults: the checkpoint's)."""
    inv, factor = inverse_frequencies(cfg, max_len, theta, scaling)
    return Rotary.table(inv, factor, max_len, device, dtype)
