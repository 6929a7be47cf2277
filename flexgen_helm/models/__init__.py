"""Architectures. Each family module provides `layer_specs(cfg)`, `run_constants(cfg,
max_len, device, dtype)` (what a run computes once for every step: the rotary tables),
`step_constants(constants, positions)` (what every layer of one step shares: the rotary
cos/sin at the step's positions), and the per-layer math: `embed`, `qkv` (given the step
constants and the block's index), `finish_block`, `head` (attention itself lives in the
executor, which knows where the KV cache is, and reads each block's sliding window and
soft-cap from the ModelConfig)."""

from __future__ import annotations

from types import ModuleType

from flexgen_helm.models import gemma, llama, moe, opt, phi3
from flexgen_helm.models.config import ModelConfig

FAMILIES: dict[str, ModuleType] = {"opt": opt, "llama": llama, "gemma": gemma, "phi3": phi3, "moe": moe}

# transformers' model_type -> our family
HF_MODEL_TYPES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
                  "gemma2": "gemma", "gemma3_text": "gemma", "gemma3": "gemma", "phi3": "phi3",
                  **{t: "moe" for t in moe.MOE_MODEL_TYPES}}


def family_of(cfg: ModelConfig) -> ModuleType:
    return FAMILIES[cfg.family]
