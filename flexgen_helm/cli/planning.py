"""`flexgen-helm profile` (this machine's speeds for the cost model) and `flexgen-helm search`
(the fastest policy under memory budgets)."""

from __future__ import annotations

import json
from pathlib import Path

from flexgen_helm.cli.options import (
    add_model_args,
    add_policy_args,
    add_workload_args,
    check_workload,
    checked_output_file,
    pinned_fields,
)
from flexgen_helm.planner.hardware_profile import HardwareProfile, default_profile_path, describe, measure


def cmd_profile(args) -> int:
    path = checked_output_file(args.json) or default_profile_path()
    if args.refit:
        from flexgen_helm.tools.validation.refit import refit

        profile = HardwareProfile.load(path) if path.exists() else measure(args.offload_dir)
        profile, report = refit(profile, [Path(p) for p in args.refit])
        print(report)
    else:
        profile = measure(args.offload_dir, device=args.device, dtype=args.dtype)
    print(describe(profile))
    print(f"saved: {profile.save(path)}")
    return 0


def cmd_search(args) -> int:
    from flexgen_helm.memory.devices import pick_devices
    from flexgen_helm.planner.auto import budgets_from_args, options_for, search_for
    from flexgen_helm.weights.registry import resolve

    checked_output_file(args.json)
    checked_output_file(args.policy_out)
    # a search plans from the config alone: no weights are read, so none are required
    cfg = resolve(args.model, path=args.path, dummy=True).config
    options = options_for(pinned_fields(args), args.max_latency)  # the flags given fix what they set
    options.max_gpu_batch_size, options.max_num_gpu_batches = args.max_gpu_batch_size, args.max_num_gpu_batches
    dtype = pick_devices(args.device, args.dtype).dtype
    check_workload(args)
    result = search_for(cfg, args.prompt_len, args.gen_len, budgets_from_args(args), options,
                        offload_dir=args.offload_dir, profile_path=args.profile, dtype=dtype,
                        shared_prefix=args.shared_prefix)
    est = result.estimate
    print(f"model: {cfg.name}, prompt {args.prompt_len}, {args.gen_len} new tokens")
    print(f"policy: {result.policy.describe()}")
    print(est.describe())
    print("best of each block shape:")
    for c in result.candidates[:args.show]:
        e = c.estimate
        print(f"  gbs={c.policy.gpu_batch_size:3d} x nb={c.policy.num_gpu_batches:3d}: {e.throughput:8.2f} token/s, "
              f"latency {e.total_s:9.1f} s, bottleneck {e.bottleneck['prefill']}/{e.bottleneck['decode']}, "
              f"weights {'/'.join(f'{100 * f:g}' for f in c.policy.weights.as_tuple())}")
    if args.json:
        record = {"model": cfg.name, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                  "policy": result.policy.to_dict(), "policy_summary": result.policy.describe(),
                  "predicted": {"throughput": est.throughput, "total_s": est.total_s, "prefill_s": est.prefill_s,
                                "decode_step_s": est.decode_step_s, "prefill_terms": est.prefill_terms,
                                "decode_terms": est.decode_terms, "bottleneck": est.bottleneck,
                                "peak_bytes": est.peak_bytes}}
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.policy_out:
        Path(args.policy_out).write_text(result.policy.to_json())
    return 0


def add_command(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine's bandwidths and flops for the cost model")
    p.add_argument("--json", help=f"where to save the profile (default: {default_profile_path()})")
    p.add_argument("--offload-dir", help="where to measure disk bandwidth (default: the offload dir)")
    p.add_argument("--device")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--refit", nargs="+", metavar="BENCH_JSON",
                   help="instead of measuring, scale the saved profile's terms to match these bench results")
    p.set_defaults(func=cmd_profile)

    s = sub.add_parser("search", help="the fastest policy for a workload under memory budgets (cost model + LP)")
    add_model_args(s)
    add_policy_args(s)
    add_workload_args(s)
    s.add_argument("--max-latency", type=float, help="seconds for one block (prefill + decode): the latency bound")
    s.add_argument("--max-gpu-batch-size", type=int, default=64)
    s.add_argument("--max-num-gpu-batches", type=int, default=16)
    s.add_argument("--profile", help="hardware profile JSON (default: the saved one; profiled when missing)")
    s.add_argument("--show", type=int, default=8, help="block shapes to list")
    s.add_argument("--json", help="write the policy and the prediction here")
    s.add_argument("--policy-out", help="write the policy alone (for --policy FILE)")
    s.set_defaults(func=cmd_search)

