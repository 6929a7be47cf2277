"""`flexgen-helm compare`: ours against HF accelerate, and the ablations, in one run."""

from __future__ import annotations

from flexgen_helm.cli.options import checked_output_dir


def add_command(sub) -> None:
    from flexgen_helm.tools.compare.workloads import DEFAULT_SYSTEMS, SETUPS, SYSTEMS

    k = sub.add_parser("compare", help="ours vs HF accelerate and the ablations on the same setup, in one run")
    k.add_argument("--setup", nargs="+", default=["opt-6.7b-p512-g32"], choices=sorted(SETUPS),
                   help="model, workload, budgets and block cap (flexgen_helm/tools/compare/workloads.py)")
    k.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS,
                   help="rows to run (hf-accelerate-page-cache: accelerate without per-token eviction)")
    k.add_argument("--no-ablations", action="store_true",
                   help="skip the ablation table (no overlap, no CPU compute, row by row, no policy search)")
    k.add_argument("--profile", help="hardware profile JSON (default: the saved one; profiled when missing)")
    k.add_argument("--speed-check", action="store_true",
                   help="plan and predict each row with the profile's compute terms scaled by a few seconds' "
                        "matmul speed check just before it (for a machine whose speed drifts slowly; on a shared "
                        "host that swings within minutes it misleads)")
    k.add_argument("--warmup", type=int, default=0, help="untimed runs before each timed one (bench --warmup)")
    k.add_argument("--timeout", type=int, default=3600, help="seconds allowed to each system's run")
    k.add_argument("--out", default="runs/compare")
    k.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.tools.compare.run import main as compare_main

    checked_output_dir(args.out)  # before the store, the bandwidth and the runs
    return compare_main(args)
