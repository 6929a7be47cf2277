"""What a run will hold on each tier, checked against the user's memory budgets before
anything is allocated."""

from __future__ import annotations

import torch

from flexgen_helm.errors import PolicyError
from flexgen_helm.memory.placement import place_weights
from flexgen_helm.models import family_of
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.policy.policy import TIERS, Policy


def planned_bytes(cfg: ModelConfig, policy: Policy, max_len: int, dtype: torch.dtype) -> dict[str, int]:
    """Weights, KV cache and activations (one block) per tier, before transient buffers."""
    elt = torch.empty((), dtype=dtype).element_size()
    layers = family_of(cfg).layer_specs(cfg)
    sizes = {t.store_name: t.row_numel for layer in layers for t in layer.owned()}
    out = {t: 0 for t in TIERS}
    for name, segments in place_weights(layers, policy.weights).items():
        for s in segments:
            out[s.tier] += s.rows * sizes[name] * elt
    cache = 2 * cfg.num_layers * policy.block_size * cfg.num_kv_heads * max_len * cfg.head_dim * elt
    act = policy.block_size * max_len * cfg.hidden_size * elt
    for tier in TIERS:
        out[tier] += int(cache * getattr(policy.cache, tier)) + int(act * getattr(policy.activations, tier))
    return out


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
