"""`flexgen-helm <command>`: generate, bench, convert, eval (and the commands later issues add)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flexgen_helm.errors import FlexGenError
from flexgen_helm.policy.policy import Compression, Policy


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name (smollm2-135m, facebook/opt-1.3b, ...) or local path")
    p.add_argument("--path", help="local checkpoint directory or GGUF file for the model")
    p.add_argument("--dummy", action="store_true", help="random weights of the right shapes (benchmarks)")
    p.add_argument("--offload-dir", help="directory for disk-tier tensors (default: $FLEXGEN_HELM_OFFLOAD or /tmp)")
    p.add_argument("--device", help="compute device (default: cuda if present, else cpu)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="weights and compute (default: float16 on GPU; on CPU bfloat16 where the CPU "
                        "computes it natively, else float32)")
    p.add_argument("--pipeline", action="store_true",
                   help="run as one stage of a pipeline over the processes torchrun started")


def engine_class(args):
    """The single-process engine, or one pipeline stage under torchrun (--pipeline)."""
    if getattr(args, "pipeline", False):
        from flexgen_helm.dist.pipeline import PipelineEngine

        return PipelineEngine
    from flexgen_helm.engine import Engine

    return Engine


def is_reporting_rank(engine) -> bool:
    """Under a pipeline every rank holds the results; only the first one prints them."""
    return getattr(engine, "rank", 0) == 0


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
    g.add_argument("--attn-sparsity", type=float, default=1.0, help="fraction of keys kept in decode attention")


def policy_from_args(args) -> Policy:
    if args.policy == "auto":
        from flexgen_helm.policy.auto import policy_for_command

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
    comp = Compression(args.compress_bits, args.compress_group_size, args.compress_group_dim)
    if args.compress_weight:
        changes["compress_weight"] = comp.__dict__
    if args.compress_cache:
        changes["compress_cache"] = comp.__dict__
    if args.attn_sparsity != 1.0:
        changes["attn_sparsity"] = args.attn_sparsity
    return Policy.from_dict(changes)


def cmd_generate(args) -> int:
    from flexgen_helm.executor.sampling import SamplingParams

    engine = engine_class(args).load(args.model, policy_from_args(args), path=args.path, dummy=args.dummy,
                         offload_dir=args.offload_dir, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, num_completions=args.num_completions,
                            stop_strings=tuple(args.stop or ()))
    results = engine.generate(args.prompt, params)
    engine.close()
    if not is_reporting_rank(engine):
        return 0
    out = []
    for prompt, r in zip(args.prompt, results):
        for c in r.completions:
            print(f"{prompt}\033[1m{c.text}\033[0m" if sys.stdout.isatty() else f"{prompt}{c.text}")
            print("-" * 40)
        out.append({"prompt": prompt, "prompt_token_ids": r.prompt_token_ids,
                    "completions": [c.__dict__ for c in r.completions]})
    stats = engine.last_stats
    print(f"{stats['generated_tokens']} tokens in {stats['total_s']:.2f} s "
          f"({stats['generated_tokens'] / max(stats['total_s'], 1e-9):.1f} token/s); policy: {engine.policy.describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": out, "stats": stats, "policy": engine.policy.to_dict()}, indent=1))
    return 0


def cmd_bench(args) -> int:
    from flexgen_helm.bench import run_bench

    run_bench(args, policy_from_args(args))
    return 0


def cmd_convert(args) -> int:
    from flexgen_helm.weights.loading import convert_named

    out = convert_named(args.model, path=args.path, dummy=args.dummy, dtype=args.dtype or "float16", out_dir=args.out,
                        verify=args.verify)
    print(f"store ready: {out}")
    return 0


def cmd_eval(args) -> int:
    from flexgen_helm.evaluation.run import run_eval

    try:
        run_eval(args, policy_from_args(args), args.argv)
    except FileNotFoundError as e:  # missing evaluation data: say which file and how to point at it
        raise FlexGenError(str(e)) from e
    return 0


def cmd_compare(args) -> int:
    from flexgen_helm.compare.run import main as compare_main

    return compare_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexgen-helm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    add_model_args(g)
    add_policy_args(g)
    g.add_argument("--prompt", nargs="+", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-completions", type=int, default=1)
    g.add_argument("--stop", nargs="*", help="stop strings")
    g.add_argument("--json", help="write prompts, completions, token ids and logprobs here")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure generation throughput (FlexGen's flags)")
    add_model_args(b)
    add_policy_args(b)
    b.add_argument("--prompt-len", type=int, default=512)
    b.add_argument("--gen-len", type=int, default=32)
    b.add_argument("--gpu-mem", help="GPU budget, e.g. 16GiB")
    b.add_argument("--cpu-mem", help="CPU RAM budget, e.g. 4GiB")
    b.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed one")
    b.add_argument("--json", help="write the measurements here")
    b.add_argument("--label", help="name of this setting in reports (e.g. 'no overlap'; see flexgen_helm/report)")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("convert", help="convert a model into the engine's per-tensor store")
    add_model_args(c)
    c.add_argument("--out", help="store directory (default: the cache)")
    c.add_argument("--verify", action="store_true", help="re-read every tensor and check its checksum")
    c.set_defaults(func=cmd_convert)

    from flexgen_helm.report.cli import add_commands as add_report_commands  # report, demo

    add_report_commands(sub)

    from flexgen_helm.policy.commands import add_commands

    add_commands(sub, add_model_args, add_policy_args)  # profile, search

    e = sub.add_parser("eval", help="accuracy: LAMBADA last-word accuracy, WikiText perplexity")
    add_model_args(e)
    add_policy_args(e)
    e.add_argument("--task", choices=["lambada", "wikitext"], required=True)
    e.add_argument("--data", help="the task's data file, or a data folder (default: $FLEXGEN_HELM_DATA, "
                                  "../shared/data, else the hub when online)")
    e.add_argument("--limit", type=int, help="LAMBADA: the first N passages; WikiText: the first N tokens")
    e.add_argument("--window", type=int, default=1024, help="WikiText window in tokens (capped at the context)")
    e.add_argument("--generate", action="store_true",
                   help="LAMBADA: also measure accuracy by greedy generation (the decode path, where KV-cache "
                        "compression and sparse attention act; a plain score runs the prefill only)")
    e.add_argument("--score-as-decode", action="store_true",
                   help="score every token as if the engine had generated it: attention through the KV cache, "
                        "compressed and sparse as the policy says (a plain score's prefill attends to fresh keys "
                        "and values, where neither acts); the same numbers without cache compression or sparsity")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.add_argument("--json", help="write the record here")
    e.set_defaults(func=cmd_eval)
    from flexgen_helm.compare.workloads import DEFAULT_SYSTEMS, SETUPS, SYSTEMS

    k = sub.add_parser("compare", help="ours vs HF accelerate (and the ablations) on the same setup, in one run")
    k.add_argument("--setup", nargs="+", default=["opt-6.7b-p512-g32"], choices=sorted(SETUPS),
                   help="model, workload and budgets (flexgen_helm/compare/workloads.py)")
    k.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS,
                   help="rows to run (hf-accelerate-page-cache: accelerate without per-token eviction)")
    k.add_argument("--ablations", choices=sorted(SETUPS), help="also run the ablations on this setup")
    k.add_argument("--ablations-only", action="store_true")
    k.add_argument("--max-block", type=int, default=4,
                   help="cap on our effective batch (prefill compute per sequence is minutes on 2 CPU cores)")
    k.add_argument("--warmup", type=int, default=0, help="untimed runs before each timed one (bench --warmup)")
    k.add_argument("--timeout", type=int, default=1500, help="seconds allowed to each system's run")
    k.add_argument("--out", default="runs/compare")
    k.set_defaults(func=cmd_compare)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded verbatim by commands that write results
    try:
        return args.func(args)
    except FlexGenError as e:
        print(f"flexgen-helm: error: {e}", file=sys.stderr)
        return 2
