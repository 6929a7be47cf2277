"""The least time any implementation could need for a language-modeling run on this
machine: the run's matmul and attention arithmetic at the best matrix-multiply rate the
hardware profile measured.

Scoring a request is one causal forward pass over its tokens, so its arithmetic is fixed
by the requests' lengths, whatever the batching; no part of it (attention included, whose
QK^T and PV are matrix products) runs faster than the machine's peak matmul rate. A
system's wall time over this floor says how far from the machine's limit it is."""

from __future__ import annotations

from dataclasses import dataclass

from flexgen_helm.models.config import ModelConfig
from flexgen_helm.planner.hardware_profile import HardwareProfile


@dataclass(frozen=True)
class ComputeFloor:
    linear_flop: float
    attention_flop: float  # the causal half of QK^T and PV
    peak_flops_per_s: float

    @property
    def seconds(self) -> float:
        return (self.linear_flop + self.attention_flop) / self.peak_flops_per_s


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights every token multiplies: q, k, v, o and the MLP of each block, and the head; of a
    mixture of experts' sparse block, the router and the k experts the token takes (and the
    shared one): its active parameters."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = (2 if cfg.family == "opt" else 3) * cfg.hidden_size * cfg.ffn_size  # fc1, fc2 / gate, up, down
    sparse = (cfg.num_experts + 3 * cfg.experts_per_token * cfg.expert_ffn_size + 3 * cfg.shared_expert_ffn_size
              + (1 if cfg.shared_expert_ffn_size else 0)) * cfg.hidden_size
    attention = cfg.hidden_size * (2 * q_out + 2 * kv_out)
    return sum(attention + (sparse if cfg.sparse_block(i) else mlp) for i in range(cfg.num_layers)) \
        + cfg.vocab_size * cfg.hidden_size


def compute_floor(cfg: ModelConfig, request_tokens: list[int], profile: HardwareProfile) -> ComputeFloor:
    width = cfg.num_heads * cfg.head_dim
    linear = 2.0 * matmul_params_per_token(cfg) * sum(request_tokens)
    attention = sum(2.0 * t * t * width * cfg.num_layers for t in request_tokens)
    peak = max(max(table.values()) for table in profile.compute.matmul_flops.values())
    return ComputeFloor(linear, attention, peak)
