"""A row's roofline on a CPU: the least time its run could take on this machine, phase by
phase, given the block it ran and where its weights lived:

    prefill     >= max(its matmuls at the profiled matmul rate for that many rows,
                       its disk-resident weights at the device's read bandwidth)
    decode step >= max(the same for one token per sequence, the same weight bytes)

The matmuls are every Linear of the model (compute_floor.matmul_params_per_token) times the
tokens, plus causal attention; the rate is the hardware profile's for the rows multiplied at
once (a prefill's GPU batch x prompt; a decode step's whole block, whose GPU batches go
through a transformer block's linears together), because that is what the row's own block
shape lets the CPU reach. The bytes are the weights placed on disk, read
once per step, and in a decode step the KV cache (and activations) the policy put on disk,
read as long as the step's sequences are so far (the mean over the steps); the prefill's
writes of that cache are not counted, so a row's percent of its roofline can only understate
how close it is."""

from __future__ import annotations

from dataclasses import dataclass

from flexgen_helm.models.config import ModelConfig
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token


@dataclass(frozen=True)
class Roofline:
    prefill_s: float
    decode_step_s: float
    prefill_bound: str  # "compute" or "disk"
    decode_bound: str
    total_s: float
    tokens_per_s: float


def roofline(cfg: ModelConfig, profile: HardwareProfile, dtype: str, batch: int, gpu_batch: int, prompt_len: int,
             gen_len: int, disk_weight_bytes: float, disk_bytes_per_s: float, disk_cache_bytes: float = 0.0
             ) -> Roofline:
    """`disk_cache_bytes`: the block's KV cache and activations on the disk tier at full length."""
    params = matmul_params_per_token(cfg)
    width = cfg.num_heads * cfg.head_dim
    disk_s = disk_weight_bytes / disk_bytes_per_s
    dev = profile.compute

    pre_flop = batch * (2.0 * params * prompt_len + 2.0 * prompt_len * prompt_len * width * cfg.num_layers)
    pre_compute = pre_flop / dev.linear_flops(dtype, gpu_batch * prompt_len)
    mean_keys = prompt_len + gen_len / 2
    dec_flop = batch * (2.0 * params + 4.0 * mean_keys * width * cfg.num_layers)
    dec_compute = dec_flop / dev.linear_flops(dtype, batch)

    dec_disk_s = disk_s + disk_cache_bytes * mean_keys / (prompt_len + gen_len) / disk_bytes_per_s
    prefill, decode = max(pre_compute, disk_s), max(dec_compute, dec_disk_s)
    total = prefill + (gen_len - 1) * decode
    return Roofline(prefill, decode, "compute" if pre_compute >= disk_s else "disk",
                    "compute" if dec_compute >= dec_disk_s else "disk", total, batch * gen_len / total)
