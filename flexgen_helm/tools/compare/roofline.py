"""A row's roofline on a CPU: the least time its run could take on this machine, phase by
phase, given the block it ran and where its weights lived:

    prefill     >= max(its matmuls at the profiled matmul rate for that many rows,
                       its disk-resident weights at the device's read bandwidth,
                       its RAM-resident weights at RAM's bandwidth)
    decode step >= max(the same for one token per sequence, the same disk bytes,
                       the RAM-resident weights and KV cache it reads at RAM's bandwidth)

The matmuls are every Linear of the model (compute_floor.matmul_params_per_token) times the
tokens, plus causal attention; the rate is the hardware profile's for the rows multiplied at
once (a prefill's GPU batch x prompt; a decode step's whole block, whose GPU batches go
through a transformer block's linears together), because that is what the row's own block
shape lets the CPU reach. The bytes are the weights placed on disk, read
once per step, and in a decode step the KV cache (and activations) the policy put on disk,
read as long as the step's sequences are so far (the mean over the steps); the prefill's
writes of that cache are not counted, so a row's percent of its roofline can only understate
how close it is.

RAM's bandwidth is the profile's memcpy rate counted as traffic: a copy reads and writes each
byte, so reading alone may move RAM_TRAFFIC_PER_COPIED_BYTE bytes in the time a copy moves one.
The weights a pass reads are weights_read_share of those held (an MoE step reads only the
experts its tokens choose); the cache, as long as the step's sequences are on average. Without
it, a CPU run whose weights sit in RAM had a decode "bound" by its few rows' matmuls: OLMoE-1B-7B
at block 16, 159 ms a step, where reading the ~4.5 GB its step needs takes 219 ms
(runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_row_buckets_b). The roof applies to a CPU's
rows (on a GPU the weights it reads come from its own memory, which the profile does not time),
and to rows whose records say what they hold in RAM (ours; accelerate's keep their compute and
disk roofs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexgen_helm.executor.kv_cache import kv_nbytes
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.moe import expected_experts_touched
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import Policy
from flexgen_helm.tools.compare import table
from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token

RAM_TRAFFIC_PER_COPIED_BYTE = 2  # a memcpy reads each byte and writes it


@dataclass(frozen=True)
class Roofline:
    prefill_s: float
    decode_step_s: float
    prefill_bound: str  # "compute", "disk" or "memory"
    decode_bound: str
    total_s: float
    tokens_per_s: float


def weights_read_share(cfg: ModelConfig, rows: float) -> float:
    """Of a model's weights, the share a pass over `rows` tokens reads, every parameter counted
    alike: all but an embedding table the head does not share (looked up, not read) and, of a
    mixture of experts, the experts its rows do not choose (expected_experts_touched: routing
    taken as uniform)."""
    sparse = sum(cfg.sparse_block(i) for i in range(cfg.num_layers))
    expert = 3 * cfg.hidden_size * cfg.expert_ffn_size
    rest = matmul_params_per_token(cfg) - sparse * cfg.experts_per_token * expert  # all but the experts
    touched = expected_experts_touched(cfg.num_experts, cfg.experts_per_token, rows) if sparse else 0.0
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (rest + sparse * touched * expert) / (rest + sparse * cfg.num_experts * expert + embedding)


def ram_resident(cfg: ModelConfig, profile: HardwareProfile, policy: Policy | None, record: dict, batch: int,
                 positions: int, dtype: torch.dtype) -> dict[str, float]:
    """roofline's RAM arguments for a row: the weights our run placed in RAM (table.ram_weight_bytes)
    and the block's KV cache at `positions` on the tiers a CPU run keeps in RAM (its gpu and cpu
    tiers), as stored (compressed where the policy compresses it; a sliding-window layer's, its
    window's worth, all it keeps). Empty for a GPU's rows and for rows without a policy of ours
    (no memory roof)."""
    if policy is None or profile.is_cuda:
        return {}
    cache = sum(kv_nbytes(min(positions, cfg.window(i) or positions), batch * cfg.num_kv_heads, cfg.head_dim,
                          dtype, policy.compress_cache) for i in range(cfg.num_layers))
    return {"ram_weight_bytes": table.ram_weight_bytes(record),
            "ram_cache_bytes": cache * (policy.cache.gpu + policy.cache.cpu)}


def roofline(cfg: ModelConfig, profile: HardwareProfile, dtype: str, batch: int, gpu_batch: int, prompt_len: int,
             gen_len: int, disk_weight_bytes: float, disk_bytes_per_s: float, disk_cache_bytes: float = 0.0,
             ram_weight_bytes: float = 0.0, ram_cache_bytes: float = 0.0) -> Roofline:
    """`disk_cache_bytes`: the block's KV cache and activations on the disk tier at full length;
    `ram_weight_bytes`, `ram_cache_bytes`: the weights and the block's KV cache (at full length)
    a CPU run holds in RAM (0: no memory roof)."""
    params = matmul_params_per_token(cfg)
    width = cfg.num_heads * cfg.head_dim
    disk_s = disk_weight_bytes / disk_bytes_per_s
    dev = profile.compute
    ram_bytes_per_s = RAM_TRAFFIC_PER_COPIED_BYTE * profile.memcpy_bytes_per_s

    pre_flop = batch * (2.0 * params * prompt_len + 2.0 * prompt_len * prompt_len * width * cfg.num_layers)
    pre_compute = pre_flop / dev.linear_flops(dtype, gpu_batch * prompt_len)
    pre_ram = ram_weight_bytes * weights_read_share(cfg, batch * prompt_len) / ram_bytes_per_s
    mean_keys = prompt_len + gen_len / 2
    dec_flop = batch * (2.0 * params + 4.0 * mean_keys * width * cfg.num_layers)
    dec_compute = dec_flop / dev.linear_flops(dtype, batch)
    dec_ram = (ram_weight_bytes * weights_read_share(cfg, batch)
               + ram_cache_bytes * mean_keys / (prompt_len + gen_len)) / ram_bytes_per_s

    dec_disk_s = disk_s + disk_cache_bytes * mean_keys / (prompt_len + gen_len) / disk_bytes_per_s
    prefill = {"compute": pre_compute, "disk": disk_s, "memory": pre_ram}
    decode = {"compute": dec_compute, "disk": dec_disk_s, "memory": dec_ram}
    total = max(prefill.values()) + (gen_len - 1) * max(decode.values())
    return Roofline(max(prefill.values()), max(decode.values()), max(prefill, key=prefill.get),
                    max(decode, key=decode.get), total, batch * gen_len / total)
