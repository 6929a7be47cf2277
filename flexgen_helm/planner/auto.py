"""The policy a command runs under: what the user set, and the planner's choice (the cost
model and the LP search, with this machine's profile and memory budgets) for the rest, for
the command's own workload. One rule for generate, bench, eval and the HELM plugin, by
default and with `--policy auto`:

- every Policy field the user gave (a flag, a field of a policy file or of a deployment's
  mapping) is kept as given; the search chooses the block (GPU batch size, number of GPU
  batches) and the placement where they are left open, the fastest it predicts, the
  smallest block among predictions within 2% of the fastest (planner/search.py);
- the choice is a function of the workload, the budgets and the saved profile alone (no
  timing enters it): the same command gives the same block, run after run;
- without a saved profile of this machine, the default runs the engine's fixed default
  for what was left open (one sequence per block, all on the compute device's tier) and
  says so in one line; `--policy auto` (or `policy: auto`) profiles the machine first.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from flexgen_helm.compression.grids import WeightGrids, takes_source_codes
from flexgen_helm.errors import PolicyError
from flexgen_helm.models import family_of
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.spec import all_store_tensors
from flexgen_helm.planner.budget import parse_size
from flexgen_helm.planner.hardware_profile import HardwareProfile, load_or_profile, saved_profile
from flexgen_helm.planner.search import SearchOptions, SearchResult, default_budgets, search
from flexgen_helm.policy.policy import Policy
from flexgen_helm.weights.source import WeightSource
from flexgen_helm.weights.source_grids import weight_grids

BLOCK_FIELDS = ("gpu_batch_size", "num_gpu_batches")
PLACEMENT_FIELDS = ("weights", "cache", "activations")


@dataclass(frozen=True)
class CommandWorkload:
    """What a command will run, as the search sees it."""

    prompt_len: int  # the longest prompt, in tokens (the budgets must hold it)
    gen_len: int  # new tokens per sequence; 1 for scoring (a prefill, and the head on the last position)
    sequences: int | None = None  # how many the command runs (a bigger block would be padding); None: many
    shared_prefix: int = 0  # tokens every prompt starts with (a block computes them, and holds their KV, once)


def search_for(cfg: ModelConfig, prompt_len: int, gen_len: int, budgets: dict | None = None,
               options: SearchOptions | None = None, offload_dir: str | None = None,
               profile_path: str | None = None, dtype=None, profile: HardwareProfile | None = None,
               shared_prefix: int = 0) -> SearchResult:
    """`budgets`: tier -> bytes or text ("4GiB") or None. Without `profile`, the saved one,
    or the machine profiled first when none is saved."""
    profile = profile or load_or_profile(profile_path, offload_dir=offload_dir)
    b = {k: parse_size(v) if isinstance(v, str) else v for k, v in (budgets or {}).items()}
    budget = default_budgets(profile, b.get("gpu"), b.get("cpu"), b.get("disk"))
    return search(cfg, profile, prompt_len, gen_len, budget, options, dtype=dtype, shared_prefix=shared_prefix)


def options_for(pinned: dict, max_latency_s: float | None = None) -> SearchOptions:
    """Search options that keep every field of `pinned` (Policy fields, as Policy.to_dict
    writes them) as given: compression is always the user's choice; CPU delegation, and
    whether a block keeps dense copies of compressed weights or holds a compressed cache's
    values dense, are searched unless set."""
    given = Policy.from_dict(pinned)  # a bad value fails here, before any work
    placed = any(k in pinned for k in PLACEMENT_FIELDS)
    return SearchOptions(
        compress_weight=given.compress_weight, compress_cache=given.compress_cache,
        cpu_cache_compute=pinned.get("cpu_cache_compute"), keep_dense_weights=pinned.get("keep_dense_weights"),
        keep_dense_cache=pinned.get("keep_dense_cache"),
        max_latency_s=max_latency_s, overlap=given.overlap,
        gpu_batch_size=pinned.get("gpu_batch_size"), num_gpu_batches=pinned.get("num_gpu_batches"),
        placement=tuple(getattr(given, k) for k in PLACEMENT_FIELDS) if placed else None,
    )


def leaves_open(pinned: dict) -> bool:
    """Whether the search has anything to choose: a block dimension or the placement."""
    return not all(k in pinned for k in BLOCK_FIELDS) or not any(k in pinned for k in PLACEMENT_FIELDS)


def planned_policy(cfg: ModelConfig, workload: CommandWorkload, pinned: dict | None = None,
                   budgets: dict | None = None, profile_when_missing: bool = False, max_latency_s: float | None = None,
                   offload_dir: str | None = None, dtype=None, source: WeightSource | None = None) -> Policy:
    """The policy for `workload`: `pinned` as given, the planner's choice for the rest (see
    the module doc; `profile_when_missing`: `--policy auto`, which profiles a machine
    without a saved profile instead of running the fixed default). `source`: the model's
    weights, whose GGUF codes a compression that keeps them stores tensor by tensor
    (stored_grids), priced as stored."""
    pinned = dict(pinned or {})
    if not leaves_open(pinned):
        return Policy.from_dict(pinned)
    profile, missing = saved_profile()
    if profile is None and not profile_when_missing:
        policy = Policy.from_dict(pinned)
        print(f"flexgen-helm: {missing}, so the planner cannot choose: running the engine's default for what was "
              f"not set ({policy.describe()}); `flexgen-helm profile` (under a minute) lets it pick the fastest "
              "block for this machine", file=sys.stderr, flush=True)
        return policy
    policy, result = searched_policy(cfg, workload, pinned, profile, budgets, max_latency_s, offload_dir, dtype,
                                     weight_grids=stored_grids(cfg, pinned, source))
    if result.unshared_because:
        print(f"flexgen-helm: {result.unshared_because}", file=sys.stderr, flush=True)
    shared = workload.shared_prefix if policy.prefix_sharing else 0
    work = "scoring" if workload.gen_len <= 1 else f"{workload.gen_len} new tokens"
    common = f", the first {shared} shared" if shared else ""
    print(f"planned policy for {cfg.name} (prompts up to {workload.prompt_len} tokens{common}, {work}): "
          f"{policy.describe()}; predicted {result.estimate.throughput:.2f} "
          f"{'sequences' if workload.gen_len <= 1 else 'token'}/s", file=sys.stderr, flush=True)
    return policy


def stored_grids(cfg: ModelConfig, pinned: dict, source: WeightSource | None) -> WeightGrids | None:
    """The pinned compress_weight as the engine will store `source`'s weights, where it keeps a
    GGUF's own codes (each tensor in its file's format: the bundled SmolLM2's Q8_0 table beside
    its Q4_1 blocks), for the search to price them as stored (SearchOptions.weight_grids); None
    where the setting says it all. A source that holds no codes is refused here, as at load."""
    setting = Policy.from_dict(pinned).compress_weight
    if source is None or not takes_source_codes(setting):
        return None
    return weight_grids(setting, source, all_store_tensors(family_of(cfg).layer_specs(cfg)), say=False)


def searched_policy(cfg: ModelConfig, workload: CommandWorkload, pinned: dict, profile: HardwareProfile | None,
                    budgets: dict | None = None, max_latency_s: float | None = None, offload_dir: str | None = None,
                    dtype=None, placement: tuple | None = None, weight_grids: WeightGrids | None = None
                    ) -> tuple[Policy, SearchResult]:
    """The search's policy for `workload` with `pinned` kept (and `placement`, the weights',
    cache's and activations' Splits, where given; and `weight_grids`, the compressed weights as
    a loaded engine stores them: SearchOptions.weight_grids), said nothing about; and the search's result.
    The shared prefix counts where the policy shares prefixes (`prefix_sharing`, default on);
    where held once it fits no block but per sequence it does, and `prefix_sharing` is not
    pinned, the policy does not share it and the result says why (`unshared_because`)."""
    options = options_for(pinned, max_latency_s)
    options.weight_grids = weight_grids
    if placement is not None:
        options.placement = placement
    if workload.sequences is not None:  # a bigger block than the sequences is padding, unless the user set it
        cap = 1 << max(0, workload.sequences - 1).bit_length()
        options.max_block_size = max(cap, (options.gpu_batch_size or 1) * (options.num_gpu_batches or 1))
        options.max_gpu_batch_size = min(options.max_gpu_batch_size, cap)
    shared = workload.shared_prefix if pinned.get("prefix_sharing", True) else 0
    try:
        result = search_for(cfg, workload.prompt_len, workload.gen_len, budgets, options, offload_dir=offload_dir,
                            dtype=dtype, profile=profile, shared_prefix=shared)
    except PolicyError as e:
        if not shared or "prefix_sharing" in pinned:
            raise
        # The prefix's one copy sits on the compute tier (planner/budget.planned_components),
        # where the cache's rows may be offloaded: without it every sequence holds its own copy
        # wherever the policy places the cache, and may fit where the one copy does not.
        result = search_for(cfg, workload.prompt_len, workload.gen_len, budgets, options, offload_dir=offload_dir,
                            dtype=dtype, profile=profile)
        result = replace(result, policy=replace(result.policy, prefix_sharing=False), unshared_because=(
            f"the {shared} tokens every prompt starts with are computed and held per sequence: with their KV held "
            f"once, no block fits ({e})"))
    return Policy.from_dict({**result.policy.to_dict(), **pinned}), result


def budgets_from_args(args) -> dict:
    return {"gpu": getattr(args, "gpu_mem", None), "cpu": getattr(args, "cpu_mem", None),
            "disk": getattr(args, "disk_mem", None)}


# HELM deployments: a deployment's requests are not known when its engine loads, so the block
# is planned for the requests where it matters (a scenario's: helm/block_planning.py). In the
# loaded block helm/batching.py caps a batch at 8192 padded prompt tokens, so long prompts run
# in smaller batches whatever the block; short ones fill it: 64 prompts of 128 tokens reach
# that cap (a bigger block would never fill). 32 new tokens:
# HELM's generation scenarios (a word, a short answer) besides its scoring ones.
HELM_PROMPT_TOKENS, HELM_NEW_TOKENS, HELM_BATCH = 128, 32, 64


def policy_for_model(model: str, path: str | None = None, dummy: bool = False, pinned: dict | None = None,
                     auto: bool = False, device: str | None = None, dtype: str | None = None) -> Policy:
    """A HELM deployment's policy: `pinned` (its config's policy fields) and the planner's
    choice for the rest. `auto` (`policy: auto`): planned for the longest prompt the context
    allows, so that the KV cache of any request fits the machine's budgets (the machine is
    profiled first where no profile is saved); else for HELM's short prompts (above)."""
    from flexgen_helm.memory.devices import pick_devices
    from flexgen_helm.weights.registry import resolve

    resolved = resolve(model, path=path, dummy=dummy)
    cfg = resolved.config
    longest = max(1, cfg.max_seq_len - HELM_NEW_TOKENS)
    workload = (CommandWorkload(longest, HELM_NEW_TOKENS) if auto
                else CommandWorkload(min(HELM_PROMPT_TOKENS, longest), HELM_NEW_TOKENS, HELM_BATCH))
    return planned_policy(cfg, workload, pinned, profile_when_missing=auto, dtype=pick_devices(device, dtype).dtype,
                          source=resolved.source)
