"""What a run will hold on each tier, checked against the user's memory budgets before
anything is allocated."""

from __future__ import annotations

import functools

import torch

from flexgen_helm.compression.grids import WeightCompression, tensor_compression
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.kv_cache import (
    cache_rows,
    held_out_prefix,
    held_prefix_len,
    held_prefix_nbytes,
    kv_nbytes,
    rounded_group_rows,
)
from flexgen_helm.memory.placement import place_weights, slot_tier_counts, tier_totals
from flexgen_helm.memory.weight_homes import segment_nbytes
from flexgen_helm.models import family_of
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.spec import all_store_tensors
from flexgen_helm.policy.policy import TIERS, Policy, Split


def planned_components(cfg: ModelConfig, policy: Policy, max_len: int, dtype: torch.dtype, act_len: int | None = None,
                       shared_prefix: int = 0, gpu_compute: bool = False,
                       weight_compression: WeightCompression = None) -> dict[str, dict[str, int]]:
    """Bytes of weights, KV cache and activations on each tier as stored (compressed when the
    policy compresses), before transient buffers. Activations in memory hold one block of
    `act_len` positions (default max_len; a prefill's are the prompt's); on disk, their file
    is made for max_len (executor/activations.ActivationHome). shared_prefix: the tokens every
    prompt of a block starts with, whose KV a block holds once (executor/kv_cache.held_out_prefix:
    under KIVI its complete groups): its one copy, as the cache stores it, is counted where
    attention reads it: on the compute tier, and, where a GPU computes (gpu_compute) and CPU
    delegation attends to the cache's cpu and disk shares in RAM, a second copy on the cpu tier.
    weight_compression: the policy's compress_weight as the engine stores it, where known (a
    GGUF's own codes, tensor by tensor: planner/cost_model.CostModel.weight_compression);
    None: the setting, which stands for every weight."""
    elt = torch.empty((), dtype=dtype).element_size()
    stored = policy.compress_weight if weight_compression is None else weight_compression
    weights = dict(_weight_bytes(cfg, policy.weights, stored, dtype))
    cache = dict(_cache_bytes(cfg, policy, max_len, dtype, shared_prefix, gpu_compute))
    rows = _activation_rows(policy.activations, policy.gpu_batch_size, policy.num_gpu_batches)
    positions = {t: max_len if t == "disk" else act_len or max_len for t in TIERS}
    activations = {t: rows[t] * positions[t] * cfg.hidden_size * elt for t in TIERS}
    return {"weights": weights, "cache": cache, "activations": activations}


@functools.lru_cache(maxsize=1024)
def _activation_rows(split: Split, gpu_batch_size: int, num_gpu_batches: int) -> dict[str, int]:
    """Activation rows on each tier (shared: read it, never change it)."""
    return tier_totals(slot_tier_counts(split, [gpu_batch_size] * num_gpu_batches))


@functools.lru_cache(maxsize=1024)  # a search's estimate asks for each policy's cache three times
def _cache_bytes(cfg: ModelConfig, policy: Policy, max_len: int, dtype: torch.dtype, shared_prefix: int,
                 gpu_compute: bool) -> dict[str, int]:
    """The KV cache's bytes on each tier (planned_components; callers copy the dict)."""
    batches = [policy.gpu_batch_size] * policy.num_gpu_batches
    # as the schedule splits them (executor/schedule.py): slot by slot, rounding carried over
    slots = slot_tier_counts(policy.cache, [b * cfg.num_kv_heads for b in batches], range(cfg.num_layers))
    # K and V of the positions each slot holds (a sliding-window block: its window's); a unit's
    # rows are stored (and quantized) on their own, so bytes add up over the slots of one length
    rows_of = [cache_rows(max_len, cfg.window(layer), held_out_prefix(shared_prefix, cfg.window(layer), policy),
                          rounded_group_rows(policy)) for layer in range(cfg.num_layers)]
    units_by_rows: dict[int, dict[str, int]] = {}
    for (layer, _), units in slots.items():
        total = units_by_rows.setdefault(rows_of[layer], dict.fromkeys(TIERS, 0))
        for t in TIERS:
            total[t] += units[t]
    cache = {t: sum(kv_nbytes(n, units[t], cfg.head_dim, dtype, policy.cache_storage)
                    for n, units in units_by_rows.items()) for t in TIERS}
    # the one copy of each global block, stored as its slots store the prefix (compressed too),
    # on each device whose attention reads a share of the cache (executor/schedule.py)
    once = sum(bool(held_out_prefix(shared_prefix, cfg.window(layer), policy)) for layer in range(cfg.num_layers))
    held = held_prefix_len(shared_prefix, policy.compress_cache)
    for tier in prefix_copy_tiers(policy, gpu_compute):
        cache[tier] += once * held_prefix_nbytes(held, cfg.num_kv_heads, cfg.head_dim, dtype, policy.cache_storage)
    return cache


def prefix_copy_tiers(policy: Policy, gpu_compute: bool) -> set[str]:
    """The tiers holding a block's copy of its shared prefix: one per device that attends to a
    share of the cache. Attention runs on the compute device ("gpu" tier: a CPU-only machine's
    too), except that CPU delegation on a GPU machine attends to the cpu and disk shares in RAM."""
    delegated = policy.cpu_cache_compute and gpu_compute
    return {"cpu" if delegated and tier != "gpu" else "gpu"
            for tier in policy.cache.tiers()}


@functools.lru_cache(maxsize=256)  # the policy search asks for the same few placements many times
def _weight_bytes(cfg: ModelConfig, split: Split, compression: WeightCompression, dtype: torch.dtype
                  ) -> dict[str, int]:
    layers = family_of(cfg).layer_specs(cfg)
    specs = {t.store_name: t for t in all_store_tensors(layers)}
    weights = {t: 0 for t in TIERS}
    for name, segments in place_weights(layers, split, compression).items():
        for s in segments:
            own = tensor_compression(compression, name, specs[name].shape)
            weights[s.tier] += segment_nbytes(specs[name], s, own, dtype)
    return weights


def planned_bytes(cfg: ModelConfig, policy: Policy, max_len: int, dtype: torch.dtype, act_len: int | None = None,
                  shared_prefix: int = 0, gpu_compute: bool = False) -> dict[str, int]:
    """Weights, KV cache and activations (one block) per tier, before transient buffers."""
    parts = planned_components(cfg, policy, max_len, dtype, act_len, shared_prefix, gpu_compute)
    return {t: sum(p[t] for p in parts.values()) for t in TIERS}


def check_budgets(planned: dict[str, int], budgets: dict[str, int | None]) -> None:
    for tier, budget in budgets.items():
        if budget is not None and planned[tier] > budget:
            raise PolicyError(
                f"the policy needs {planned[tier] / 2**30:.2f} GiB on the {tier} tier (weights, KV cache and "
                f"activations) but the budget is {budget / 2**30:.2f} GiB: short by "
                f"{(planned[tier] - budget) / 2**30:.2f} GiB; move more to a lower tier or shrink the batch"
            )


def parse_size(text: str | None) -> int | None:
    """'16GiB', '512MB', '4G', or a plain number of GiB."""
    if text is None:
        return None
    t = text.strip().upper().replace("IB", "").replace("B", "")
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(float(t) * 2**30)
    except ValueError:
        raise PolicyError(f"cannot read memory size {text!r}; use e.g. 16GiB, 512MiB or 4") from None
