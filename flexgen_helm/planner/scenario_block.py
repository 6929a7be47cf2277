"""The block a known list of requests runs in, planned for them under weights already placed.

A HELM deployment's engine is loaded (its weights placed) before any request is known, with
a block planned for requests in general (planner/auto.py). A scenario's requests are known
before any of them runs (helm/scenario_executor.py): their longest prompt, their new tokens,
how many they are, and the tokens all of their prompts start with (a few-shot run's
instructions and examples, whose KV a block holds once: executor/shared_prefix.py). This
plans the block for them. Moving the weights would mean loading them again, so the weights'
placement stays the loaded one: where the planner would have placed them otherwise, the
block is planned under the loaded placement (cache and activations included) and the caller
says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from flexgen_helm.compression.grids import WeightGrids
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.planner.auto import CommandWorkload, searched_policy
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import Policy


@dataclass(frozen=True)
class ScenarioBlock:
    policy: Policy  # what the requests run under: the loaded weights' placement, the block planned for them
    unshared: Policy  # the planner's choice for the same requests without a shared prefix, same constraints
    # the planner's choice had it been free to place the weights again (None: it keeps the loaded placement)
    moved_weights: Policy | None
    unshared_because: str = ""  # why the requests' shared prefix is not held once (planner/auto.searched_policy)
    # the cost model's time for all of the requests under `policy`: their blocks, each full,
    # every sequence to the longest prompt and the most new tokens (an upper bound on any batch
    # of them); inf where not predicted
    predicted_s: float = math.inf


def block_for_requests(cfg: ModelConfig, loaded: Policy, pinned: dict, workload: CommandWorkload,
                       profile: HardwareProfile, dtype=None, weight_grids: WeightGrids | None = None) -> ScenarioBlock:
    """The block for `workload` (the requests' lengths, count and shared prefix), `pinned`
    (the deployment's Policy fields) kept as given, the weights where `loaded` placed them,
    priced as the loaded engine stores them (`weight_grids`: a GGUF's own codes, tensor by
    tensor). A PolicyError where nothing fits the budgets (the caller keeps the loaded policy)."""
    free, result = searched_policy(cfg, workload, pinned, profile, dtype=dtype, weight_grids=weight_grids)
    placement, moved = None, None
    if free.weights != loaded.weights:
        placement, moved = (loaded.weights, loaded.cache, loaded.activations), free
        policy, result = searched_policy(cfg, workload, pinned, profile, dtype=dtype, placement=placement,
                                         weight_grids=weight_grids)
    else:
        policy = free
    unshared = policy
    if workload.shared_prefix and policy.prefix_sharing:
        unshared, _ = searched_policy(cfg, replace(workload, shared_prefix=0), pinned, profile, dtype=dtype,
                                      placement=placement, weight_grids=weight_grids)
    blocks = math.ceil(workload.sequences / policy.block_size) if workload.sequences else 1
    return ScenarioBlock(policy, unshared, moved, result.unshared_because, blocks * result.estimate.total_s)
