"""`--policy auto`: the searched policy for a model, workload and memory budgets, for every
command that takes a policy (generate, bench, eval, the HELM plugin)."""

from __future__ import annotations

import dataclasses

from flexgen_helm.models.config import ModelConfig
from flexgen_helm.planner.budget import parse_size
from flexgen_helm.planner.hardware_profile import load_or_profile
from flexgen_helm.planner.search import SearchOptions, SearchResult, default_budgets, search
from flexgen_helm.policy.policy import Compression, Policy


def search_for(cfg: ModelConfig, prompt_len: int, gen_len: int, budgets: dict | None = None,
               options: SearchOptions | None = None, offload_dir: str | None = None,
               profile_path: str | None = None, dtype=None) -> SearchResult:
    """`budgets`: tier -> bytes or text ("4GiB") or None. Profiles the machine first when no
    profile is saved."""
    profile = load_or_profile(profile_path, offload_dir=offload_dir)
    b = {k: parse_size(v) if isinstance(v, str) else v for k, v in (budgets or {}).items()}
    budget = default_budgets(profile, b.get("gpu"), b.get("cpu"), b.get("disk"))
    return search(cfg, profile, prompt_len, gen_len, budget, options, dtype=dtype)


def options_from_args(args) -> SearchOptions:
    """Search options from the policy flags of a command (compression is the user's choice;
    CPU delegation is searched unless asked for)."""
    comp = Compression(getattr(args, "compress_bits", 4), getattr(args, "compress_group_size", 64),
                       getattr(args, "compress_group_dim", None), getattr(args, "quant_method", "rtn"))
    return SearchOptions(
        compress_weight=comp if getattr(args, "compress_weight", False) else None,
        compress_cache=dataclasses.replace(comp, cache_grouping=getattr(args, "cache_grouping", None))
        if getattr(args, "compress_cache", False) else None,
        cpu_cache_compute=True if getattr(args, "cpu_cache_compute", False) else None,
        max_latency_s=getattr(args, "max_latency", None),
        overlap=not getattr(args, "no_overlap", False),
    )


def budgets_from_args(args) -> dict:
    return {"gpu": getattr(args, "gpu_mem", None), "cpu": getattr(args, "cpu_mem", None),
            "disk": getattr(args, "disk_mem", None)}


def resolve_policy(value, cfg: ModelConfig, prompt_len: int, gen_len: int, budgets: dict | None = None,
                   options: SearchOptions | None = None, offload_dir: str | None = None, verbose: bool = True
                   ) -> Policy | None:
    """A Policy from `value`: "auto" (searched), or an argparse namespace whose `.policy` is
    "auto" (budgets and options then come from its flags); anything else is returned as is."""
    if value is not None and not isinstance(value, (str, Policy)) and hasattr(value, "policy"):
        args = value
        if args.policy != "auto":
            return args.policy
        budgets = budgets if budgets is not None else budgets_from_args(args)
        options = options or options_from_args(args)
        offload_dir = offload_dir or getattr(args, "offload_dir", None)
        value = "auto"
    if value != "auto":
        return value
    result = search_for(cfg, prompt_len, gen_len, budgets, options, offload_dir)
    if verbose:
        print(f"auto policy for {cfg.name} (prompt {prompt_len}, {gen_len} new tokens): {result.policy.describe()}; "
              f"predicted {result.estimate.throughput:.2f} token/s", flush=True)
    return result.policy


def policy_for_command(args) -> Policy:
    """`--policy auto` on generate, bench or eval: the workload from the command's own flags
    (bench: --prompt-len/--gen-len; eval: --window; generate: the prompts' characters, which
    bound their tokens, and --max-new-tokens)."""
    from flexgen_helm.weights.registry import resolve

    cfg = resolve(args.model, path=args.path, dummy=args.dummy).config
    gen_len = getattr(args, "gen_len", None) or getattr(args, "max_new_tokens", None) or 32
    prompt_len = (getattr(args, "prompt_len", None) or getattr(args, "window", None)
                  or max(map(len, getattr(args, "prompt", None) or []), default=0) or 512)
    options = options_from_args(args)
    prompts = getattr(args, "prompt", None)
    if prompts:  # generate: a block bigger than the prompts given would be padding
        sequences = len(prompts) * getattr(args, "num_completions", 1)
        options.max_gpu_batch_size = 1 << max(0, sequences - 1).bit_length()
        options.max_num_gpu_batches = 1
    return resolve_policy(args, cfg, max(1, min(prompt_len, cfg.max_seq_len - gen_len)), gen_len, options=options)


def policy_for_model(model: str, path: str | None = None, dummy: bool = False, gen_len: int = 32) -> Policy:
    """`policy: auto` in the HELM plugin, where prompts vary: searched for the longest prompt
    the context allows, so that the KV cache of any request fits, with the machine's budgets."""
    from flexgen_helm.weights.registry import resolve

    cfg = resolve(model, path=path, dummy=dummy).config
    return resolve_policy("auto", cfg, max(1, cfg.max_seq_len - gen_len), gen_len)
