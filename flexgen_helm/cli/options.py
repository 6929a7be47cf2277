"""Flags shared by several subcommands: the model, the policy, and output paths."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from flexgen_helm.errors import FlexGenError
from flexgen_helm.policy.policy import QUANT_METHODS, Compression, Policy


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="model name (smollm2-135m, facebook/opt-1.3b, ...) or local path")
    p.add_argument("--path", help="local checkpoint directory or GGUF file for the model")
    p.add_argument("--dummy", action="store_true", help="random weights of the right shapes (benchmarks)")
    p.add_argument("--offload-dir", help="directory for disk-tier tensors (default: $FLEXGEN_HELM_OFFLOAD or /tmp)")
    p.add_argument("--device", help="compute device (default: cuda if present, else cpu)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="weights and compute (default: float16 on GPU; on CPU bfloat16 where the CPU "
                        "computes it natively, else float32)")
    p.add_argument("--pipeline", action="store_true",
                   help="run as one stage of a pipeline over the processes torchrun started")


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
                        "calibration text the model samples itself, once, at conversion")
    g.add_argument("--attn-sparsity", type=float, default=1.0, help="fraction of keys kept in decode attention")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and the memory budgets of `bench` and `search` (`--policy auto` searches
    under these budgets; bench also checks a given policy against them)."""
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-mem", help="GPU budget, e.g. 16GiB (CPU-only: a pool of host RAM; the search's default: "
                                     "shares --cpu-mem)")
    p.add_argument("--cpu-mem", help="CPU RAM budget, e.g. 4GiB (the search's default: 80%% of the available RAM)")
    p.add_argument("--disk-mem", help="disk budget (the search's default: 90%% of the offload dir's free space)")


def policy_from_args(args) -> Policy:
    """The policy a command's engine runs under; the disk tier's reader is set here too (the
    faster way of reading this machine's saved profile measured)."""
    from flexgen_helm.planner.hardware_profile import use_profiled_disk_reader

    if args.policy == "auto":
        from flexgen_helm.planner.auto import policy_for_command

        base = policy_for_command(args)
    else:
        base = Policy.from_dict(json.loads(Path(args.policy).read_text())) if args.policy else Policy()
    changes = base.to_dict()
    if args.percent is not None:
        changes.update(Policy.from_percent(args.percent).to_dict())
    for name in ("gpu_batch_size", "num_gpu_batches"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    changes["overlap"] = base.overlap and not args.no_overlap
    changes["cpu_cache_compute"] = base.cpu_cache_compute or args.cpu_cache_compute
    changes["pin_weight"] = args.pin_weight
    if args.quant_method != "rtn" and not (args.compress_weight or args.compress_cache):
        raise FlexGenError(f"--quant-method {args.quant_method} chooses how compressed tensors are quantized: "
                           "add --compress-weight and/or --compress-cache")
    comp = Compression(args.compress_bits, args.compress_group_size, args.compress_group_dim, args.quant_method)
    if args.compress_weight:
        changes["compress_weight"] = comp.__dict__
    if args.compress_cache:
        changes["compress_cache"] = comp.__dict__
    if args.attn_sparsity != 1.0:
        changes["attn_sparsity"] = args.attn_sparsity
    use_profiled_disk_reader()  # after an auto policy's search, which saves a profile where none was
    return Policy.from_dict(changes)


def checked_output_file(path: str | os.PathLike | None) -> Path | None:
    """An output file the command will write at its end, made ready before any work starts:
    its folder is created, and a path that cannot be written is an error now, not after
    minutes of compute whose results would be lost."""
    if path is None:
        return None
    out = Path(path)
    if out.is_dir():
        raise FlexGenError(f"output path {out} is a directory; give a file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlexGenError(f"cannot create the folder of the output file {out}: {e}") from e
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise FlexGenError(f"output file {out} cannot be written (no write permission)")
    return out
