"""Flags shared by several subcommands: the model, the policy, and output paths."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from flexgen_helm.errors import FlexGenError
from flexgen_helm.memory.folders import unusable_reason
from flexgen_helm.policy.policy import (
    CACHE_GROUPINGS,
    DEFAULT_CACHE_GROUPING,
    QUANT_METHODS,
    SOURCE_CODE_METHODS,
    Compression,
    Policy,
)

if TYPE_CHECKING:  # the planner imports torch and scipy: only the commands that plan load it
    from flexgen_helm.planner.auto import CommandWorkload


class _DefaultModel(str):
    """--model's default, told apart from the same name given (settle_model_args)."""


DEFAULT_MODEL = _DefaultModel("smollm2-135m")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model name ({DEFAULT_MODEL}, facebook/opt-1.3b, ...) or local path (default: "
                        f"{DEFAULT_MODEL}, or with --path the checkpoint's own name)")
    p.add_argument("--path", help="local checkpoint directory or GGUF file for the model")
    p.add_argument("--dummy", action="store_true", help="random weights of the right shapes (benchmarks)")
    p.add_argument("--offload-dir", help="directory for disk-tier tensors (default: $FLEXGEN_HELM_OFFLOAD or /tmp)")
    p.add_argument("--device", help="compute device (default: cuda if present, else cpu)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="weights and compute (default: float16 on GPU; on CPU bfloat16 where the CPU "
                        "computes it natively, else float32)")
    p.add_argument("--pipeline", action="store_true",
                   help="run as one stage of a pipeline over the processes torchrun or srun started")


def settle_model_args(args: argparse.Namespace) -> None:
    """--model left out: the bundled model, or with --path the checkpoint there under its own
    name (the --path alone is what it names), so that a run of another checkpoint is never
    labelled, planned and stored as the default model's (a bench of an OLMoE GGUF once recorded
    itself as smollm2-135m)."""
    if isinstance(getattr(args, "model", None), _DefaultModel) and getattr(args, "path", None):
        args.model, args.path = args.path, None


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policy")
    g.add_argument("--policy", help="a policy JSON file (see Policy.to_json), or 'auto': searched by the cost model")
    g.add_argument("--gpu-batch-size", type=int, default=None)
    g.add_argument("--num-gpu-batches", type=int, default=None)
    g.add_argument("--percent", nargs=6, type=float, default=None, metavar="P",
                   help="weights gpu cpu, cache gpu cpu, activations gpu cpu (percent; disk gets the rest)")
    g.add_argument("--cpu-cache-compute", action="store_true", help="decode attention on the CPU for CPU/disk cache")
    g.add_argument("--no-overlap", action="store_true", help="run I/O and compute one after the other")
    g.add_argument("--pin-weight", dest="pin_weight", action="store_true", default=True)
    g.add_argument("--no-pin-weight", dest="pin_weight", action="store_false")
    g.add_argument("--compress-weight", action="store_true", help="group-wise quantized weights")
    g.add_argument("--compress-cache", action="store_true", help="group-wise quantized KV cache")
    g.add_argument("--compress-bits", type=int, default=4)
    g.add_argument("--compress-group-size", type=int, default=64)
    g.add_argument("--compress-group-dim", type=int, default=None,
                   help="dimension along which groups run (default: weights 1, the input dim the int4 "
                        "kernels take; cache the head dim)")
    g.add_argument("--quant-method", choices=QUANT_METHODS, default="rtn",
                   help="how each group's scale and minimum are chosen: rtn = min/max round-to-nearest "
                        "(FlexGen); hqq = fitted to the group's values to lower the reconstruction error "
                        "(weights: once, at conversion into the compressed store; a KV cache: at every "
                        "write, several passes per group); gptq = weights only, codes chosen against "
                        "calibration text the model samples itself, once, at conversion; gguf = weights "
                        "only, a GGUF file's own codes, scales and minimums as they are (each weight at its "
                        "file's width, groups of 32; types without such codes re-quantized by min/max onto "
                        "--compress-bits / --compress-group-size, said in a log line); a compressed cache "
                        "then takes rtn")
    g.add_argument("--cache-grouping", choices=CACHE_GROUPINGS, default=None,
                   help="which values of a compressed KV cache share a group: per-token = each position's "
                        "head-dim row (FlexGen); kivi = keys per channel over groups of --compress-group-size "
                        "tokens, values per token, a sequence's newest tokens of an unfinished group kept in full "
                        f"precision (default: {DEFAULT_CACHE_GROUPING}, the better measured, runs/accuracy)")
    g.add_argument("--attn-sparsity", type=float, default=1.0, help="fraction of keys kept in decode attention")
    g.add_argument("--keep-dense-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="a block keeps its compressed weights dequantized from their first use to its end (and for "
                        "the blocks after it, where every weight is on the gpu tier: then made at load), so decode "
                        "steps multiply dense copies instead of the int4/int8 kernels (uncompressed speed, the "
                        "memory of both); default: the planner's choice where it plans, else off")
    g.add_argument("--keep-dense-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="a compressed KV cache holds its values dense, so that decode steps do not dequantize "
                        "every held position again (the compressed cache's numbers), stored dense at uncompressed "
                        "speed and memory: per-token groups rounded as written, KIVI's groups rounded in place "
                        "once complete (a cache in memory, not on disk); default: the planner's choice where it "
                        "plans, else off")
    g.add_argument("--no-prefix-sharing", dest="prefix_sharing", action="store_false", default=True,
                   help="compute every prompt whole, even where a block's prompts start with the same tokens "
                        "(by default their common prefix is computed once per block: for A/B measurements)")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and the memory budgets of `bench` and `search` (`--policy auto` searches
    under these budgets; bench also checks a given policy against them)."""
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="the first N tokens of every prompt are the same (a few-shot run's instructions and "
                        "examples): a block computes them, and holds their KV cache, once")
    add_budget_args(p)


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """The memory budgets a planned policy (--policy auto, or flags that leave fields open) is
    searched under; `generate` takes them too."""
    p.add_argument("--gpu-mem", help="GPU budget, e.g. 16GiB (CPU-only: a pool of host RAM; the search's default: "
                                     "shares --cpu-mem)")
    p.add_argument("--cpu-mem", help="CPU RAM budget, e.g. 4GiB (the search's default: 80%% of the available RAM)")
    p.add_argument("--disk-mem", help="disk budget (the search's default: 90%% of the offload dir's free space)")


def check_budgets_steer(args) -> None:
    """Budgets given with a policy that leaves the planner nothing to choose would be ignored:
    an error saying so, before any work."""
    from flexgen_helm.planner.auto import leaves_open

    given = [f"--{name.replace('_', '-')}" for name in ("gpu_mem", "cpu_mem", "disk_mem") if getattr(args, name, None)]
    if given and not leaves_open(pinned_fields(args)):
        raise FlexGenError(f"{', '.join(given)} steer the planner, but the policy given sets the block and the "
                           "placement: leave one of them open (e.g. --policy auto) or drop the budgets")


def check_workload(args) -> None:
    """A workload that cannot run, named before any work: lengths, a shared prefix that
    leaves each prompt a token of its own, and prompts that fit the model's context."""
    from flexgen_helm.errors import FlexGenError

    if args.prompt_len < 1 or args.gen_len < 1:
        raise FlexGenError(f"--prompt-len and --gen-len are at least 1, got {args.prompt_len} and {args.gen_len}")
    if not 0 <= args.shared_prefix < args.prompt_len:
        raise FlexGenError(f"--shared-prefix {args.shared_prefix} must leave every prompt a token of its own: "
                           f"0 <= N < --prompt-len ({args.prompt_len})")
    from flexgen_helm.engine import check_fits_context
    from flexgen_helm.weights.registry import resolve

    config = resolve(args.model, path=args.path, dummy=True).config  # the config alone: no weight is read
    check_fits_context(config, "each prompt (--prompt-len)", args.prompt_len, args.gen_len)


def pinned_fields(args) -> dict:
    """The Policy fields a command's policy flags set (as Policy.to_dict writes them): with
    --policy FILE, the file's fields, then the flags over them."""
    pinned = json.loads(Path(args.policy).read_text()) if args.policy not in (None, "auto") else {}
    if args.percent is not None:
        placed = Policy.from_percent(args.percent).to_dict()
        pinned.update({k: placed[k] for k in ("weights", "cache", "activations")})
    for name in ("gpu_batch_size", "num_gpu_batches"):
        if getattr(args, name) is not None:
            pinned[name] = getattr(args, name)
    if args.no_overlap:
        pinned["overlap"] = False
    if args.cpu_cache_compute:
        pinned["cpu_cache_compute"] = True
    pinned["pin_weight"] = args.pin_weight
    if args.quant_method != "rtn" and not (args.compress_weight or args.compress_cache):
        raise FlexGenError(f"--quant-method {args.quant_method} chooses how compressed tensors are quantized: "
                           "add --compress-weight and/or --compress-cache")
    if args.cache_grouping is not None and not args.compress_cache:
        raise FlexGenError(f"--cache-grouping {args.cache_grouping} chooses how a compressed KV cache is grouped: "
                           "add --compress-cache")
    comp = Compression(args.compress_bits, args.compress_group_size, args.compress_group_dim, args.quant_method)
    if args.compress_weight:
        pinned["compress_weight"] = comp.__dict__
    if args.compress_cache:
        pinned["compress_cache"] = cache_compression(args).__dict__
    if args.attn_sparsity != 1.0:
        pinned["attn_sparsity"] = args.attn_sparsity
    if not args.prefix_sharing:
        pinned["prefix_sharing"] = False
    if args.keep_dense_weights is not None:
        pinned["keep_dense_weights"] = args.keep_dense_weights
    if args.keep_dense_cache is not None:
        pinned["keep_dense_cache"] = args.keep_dense_cache
    Policy.from_dict(pinned)  # a bad field or value fails here, before any work
    return pinned


def workload_from_args(args) -> CommandWorkload:
    """The workload of bench (--prompt-len / --gen-len) or generate (its prompts, whose
    characters bound their tokens, and --max-new-tokens; a block bigger than its sequences
    would be padding)."""
    from flexgen_helm.planner.auto import CommandWorkload

    prompts = getattr(args, "prompt", None)
    if prompts:
        return CommandWorkload(max(map(len, prompts)), args.max_new_tokens,
                               len(prompts) * getattr(args, "num_completions", 1))
    return CommandWorkload(args.prompt_len, args.gen_len, shared_prefix=getattr(args, "shared_prefix", 0))


def policy_from_args(args, workload: CommandWorkload | None = None) -> Policy:
    """The policy a command's engine runs under (planner/auto.py: the flags and --policy
    FILE as given, the planner's choice for `workload` for the rest); the disk tier's reader
    and the int4 kernel's crossover are set here too, from this machine's saved profile."""
    from flexgen_helm.memory.devices import pick_devices
    from flexgen_helm.planner.auto import CommandWorkload, budgets_from_args, leaves_open, planned_policy
    from flexgen_helm.planner.hardware_profile import use_profile
    from flexgen_helm.weights.registry import resolve

    pinned = pinned_fields(args)
    if leaves_open(pinned):
        workload = workload or workload_from_args(args)
        resolved = resolve(args.model, path=args.path, dummy=args.dummy)
        cfg = resolved.config
        prompt_len = max(1, min(workload.prompt_len, cfg.max_seq_len - workload.gen_len))
        shared = min(workload.shared_prefix, prompt_len - 1)
        policy = planned_policy(cfg, CommandWorkload(prompt_len, workload.gen_len, workload.sequences, shared), pinned,
                                budgets_from_args(args), profile_when_missing=args.policy == "auto",
                                offload_dir=args.offload_dir, dtype=pick_devices(args.device, args.dtype).dtype,
                                source=resolved.source)
    else:
        policy = Policy.from_dict(pinned)
    use_profile()  # after an auto policy's search, which saves a profile where none was
    return policy


def cache_compression(args) -> Compression:
    """The KV cache's compression the flags ask for, its grouping named (the default's
    name, so that a record says which it ran). --quant-method gguf says where the weights'
    codes come from (the file); a cache, quantized as it runs, has none: min/max (rtn)."""
    method = "rtn" if args.quant_method in SOURCE_CODE_METHODS else args.quant_method
    return Compression(args.compress_bits, args.compress_group_size, args.compress_group_dim, method,
                       args.cache_grouping or DEFAULT_CACHE_GROUPING)


def checked_output_file(path: str | os.PathLike | None) -> Path | None:
    """An output file the command will write at its end, made ready before any work starts:
    its folder is created, and a path that cannot be written is an error now, not after
    minutes of compute whose results would be lost."""
    if path is None:
        return None
    out = Path(path)
    if out.is_dir():
        raise FlexGenError(f"output path {out} is a directory; give a file name")
    checked_output_dir(out.parent)
    if out.exists() and not os.access(out, os.W_OK):
        raise FlexGenError(f"output file {out} cannot be written (no write permission)")
    return out


def checked_output_dir(path: str | os.PathLike | None) -> Path | None:
    """A folder the command will write into, made ready before any work starts: created, and
    one that cannot be created or written is an error now."""
    if path is None:
        return None
    out = Path(path)
    reason = unusable_reason(out)
    if reason is not None:
        raise FlexGenError(f"cannot create the output folder {out}, or write in it: {reason}")
    return out
