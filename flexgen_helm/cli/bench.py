"""`flexgen-helm bench`: FlexGen's benchmark flags (flexgen_helm/tools/bench.py measures)."""

from __future__ import annotations

from flexgen_helm.cli.options import (
    add_model_args,
    add_policy_args,
    add_workload_args,
    check_workload,
    checked_output_file,
    policy_from_args,
)


def add_command(sub) -> None:
    b = sub.add_parser("bench", help="measure generation throughput (FlexGen's flags)")
    add_model_args(b)
    add_policy_args(b)
    add_workload_args(b)
    b.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed one")
    b.add_argument("--json", help="write the measurements here")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.add_argument("--label", help="name of this setting in reports (e.g. 'no overlap'; see flexgen_helm/tools/report)")
    b.add_argument("--breakdown", action="store_true",
                   help="on a GPU, wait for it at the end of every timed stage, so that the per-stage breakdown is "
                        "the GPU's time (a slower run: the host cannot queue work ahead); a CPU's is exact anyway")
    b.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.tools.bench import run_bench

    checked_output_file(args.json)
    check_workload(args)
    run_bench(args, policy_from_args(args))
    return 0
