"""The block each scenario runs in, planned for its requests once they are known.

A deployment's engine loads before any request is known, its block planned for requests in
general (planner/auto.policy_for_model). The BatchingExecutor hands a scenario's requests
over whole, so their block can be planned for them: their longest prompt, their new tokens,
how many sequences they make, and the tokens every prompt starts with (a few-shot run's
instructions and in-context examples, computed and held once per block where the policy
shares prefixes: a block of them fits more sequences). Once per scenario, the weights where
loading placed them (planner/scenario_block.py); a deployment whose policy is pinned whole
keeps it. One log line per scenario says the block and why.
"""

from __future__ import annotations

from helm.common.hierarchical_logger import hlog

from flexgen_helm.compression.grids import WeightGrids
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.shared_prefix import MIN_SHARED_TOKENS, common_prefix_len
from flexgen_helm.helm.batching import GENERATE, Job
from flexgen_helm.helm.engines import EngineHandle
from flexgen_helm.memory.devices import pick_devices
from flexgen_helm.planner.auto import CommandWorkload
from flexgen_helm.planner.hardware_profile import saved_profile
from flexgen_helm.planner.scenario_block import ScenarioBlock, block_for_requests


def scenario_workload(jobs: list[Job]) -> CommandWorkload:
    """The jobs as the planner sees them. The shared prefix: the tokens every generating
    sequence (each of a prompt's n completions is one) starts with, each keeping its last
    token of its own, as the engine shares them (executor/shared_prefix.py); scoring shares
    none (every token from the second on is scored)."""
    if not jobs:
        raise ValueError("a scenario with no request to run has no block to plan")
    prompts = [j.prompt_ids for j in jobs if GENERATE in j.mode for _ in range(j.params.num_completions)]
    shared = min(common_prefix_len(prompts), min(map(len, prompts)) - 1) if len(prompts) > 1 else 0
    return CommandWorkload(
        prompt_len=max(len(j.prompt_ids) for j in jobs),
        gen_len=max((j.params.max_new_tokens for j in jobs if GENERATE in j.mode), default=1),
        sequences=len(prompts) + sum(GENERATE not in j.mode for j in jobs),
        shared_prefix=shared if shared >= MIN_SHARED_TOKENS else 0,
    )


def plan_block(handle: EngineHandle, jobs: list[Job]) -> ScenarioBlock | None:
    """The block a scenario's `jobs` run in (its `policy`, and the time the cost model
    predicts for it), planned for them and said in one log line; None: the engine's loaded
    policy (pinned, a stand-in engine, no saved profile, or no block that fits the budgets
    for them)."""
    pinned = handle.planned_fields
    if pinned is None or not jobs:
        return None
    loaded = handle.engine.policy
    profile, missing = saved_profile()
    if profile is None:
        hlog(f"flexgen: {missing}: this scenario runs in the loaded block ({loaded.describe()})")
        return None
    work = scenario_workload(jobs)
    dtype = pick_devices(handle.args.device, handle.args.dtype).dtype
    try:
        block = block_for_requests(handle.engine.config, loaded, pinned, work, profile, dtype,
                                   _stored_grids(handle))
    except PolicyError as e:
        hlog(f"flexgen: no block planned for this scenario's requests fits the budgets, so it runs in the "
             f"loaded one ({loaded.describe()}): {e}")
        return None
    if block.moved_weights is not None:
        hlog(f"flexgen: for this scenario the planner would place the weights otherwise "
             f"({block.moved_weights.describe()}); they stay where loading put them and the block is planned under "
             f"the loaded placement (moving them means loading them again)")
    policy = block.policy
    why = (f"shared prefix {work.shared_prefix} tokens, block {policy.block_size} vs {block.unshared.block_size} "
           f"without sharing" if work.shared_prefix and policy.prefix_sharing
           else "no shared prefix" if not work.shared_prefix
           else block.unshared_because or f"prefix sharing off ({work.shared_prefix} tokens in common)")
    hlog(f"flexgen: block for this scenario: gbs {policy.gpu_batch_size} x {policy.num_gpu_batches} = "
         f"{policy.block_size} sequences (was {loaded.block_size} as loaded) for {work.sequences} sequences, prompts "
         f"up to {work.prompt_len} tokens, {work.gen_len} new; {why}; predicted {block.predicted_s:.1f} s for them all")
    return block


def _stored_grids(handle: EngineHandle) -> WeightGrids | None:
    """The loaded engine's compressed weights as it stores them, where that is more than its
    policy's setting says (a GGUF's own codes, each tensor in its file's format)."""
    compression = handle.engine.runtime.weight_compression
    return compression if isinstance(compression, WeightGrids) else None
