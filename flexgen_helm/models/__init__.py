"""Architectures. Each family module provides `layer_specs(cfg)`, `run_constants(cfg,
max_len, device, dtype)` (what a run computes once for every step: Llama's rotary tables)
and `step_constants(constants, positions)` (what every layer of one step shares: the
rotary cos/sin at the step's positions), and the per-layer math: `embed`, `qkv` (given the
step constants), `finish_block`, `head`
(attention itself lives in the executor, which knows where the KV cache is)."""

from __future__ import annotations

from types import ModuleType

from flexgen_helm.models import llama, opt
from flexgen_helm.models.config import ModelConfig

FAMILIES: dict[str, ModuleType] = {"opt": opt, "llama": llama}

# transformers' model_type -> our family
HF_MODEL_TYPES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}


def family_of(cfg: ModelConfig) -> ModuleType:
    return FAMILIES[cfg.family]
