"""The gated MLP of the Llama, Gemma and Phi-3 families: down(act(gate(x)) * up(x)), with
SiLU (SwiGLU) or tanh-approximated GELU (Gemma's GeGLU), gate and up apart or fused into
one matrix (Phi-3's gate_up_proj: the gate's rows, then the up's)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flexgen_helm.models.linear import linear

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def gated_mlp(x: torch.Tensor, gate, up, down, activation: str) -> torch.Tensor:
    return linear(ACTIVATIONS[activation](linear(x, gate)) * linear(x, up), down)


def fused_gated_mlp(x: torch.Tensor, gate_up, down, activation: str) -> torch.Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(ACTIVATIONS[activation](gate) * up, down)
