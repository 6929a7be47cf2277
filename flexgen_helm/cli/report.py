"""`flexgen-helm report` (tables and plots from a suite and the JSON records),
`flexgen-helm leaderboard` (HELM's summary and web page of a suite, as a screenshot) and
`flexgen-helm demo` (the main job: helm-run, then the leaderboard and the report)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flexgen_helm.cli.options import checked_output_dir
from flexgen_helm.errors import FlexGenError


def cmd_report(args) -> int:
    from flexgen_helm.tools.report.build import build_report, suite_path

    if args.path:  # benchmark_output/runs/<suite>
        suite_dir = Path(args.path)
    elif args.suite:
        suite_dir = suite_path(args.output_path, args.suite)
    elif args.out:  # no HELM suite: a report of the bench / eval JSONs alone
        suite_dir = Path(args.out) / "no-helm-suite"
    else:
        raise FlexGenError("flexgen-helm report: give --suite NAME, a suite folder PATH, or --out DIR")
    if (args.path or args.suite) and not suite_dir.is_dir():
        raise FlexGenError(f"no HELM suite at {suite_dir.resolve()} (looked there for --suite "
                           f"{args.suite or suite_dir.name} under --output-path {args.output_path}); "
                           "run helm-run with --suite NAME first, or pass the suite's folder")
    out = checked_output_dir(Path(args.out) if args.out else Path(args.archives) / suite_dir.name)
    report = build_report(suite_dir, args.runs_dir, out, archive_root=args.archives)
    print(f"report: {report}")
    return 0


def cmd_leaderboard(args) -> int:
    from flexgen_helm.tools.report.leaderboard import make_leaderboard

    out = checked_output_dir(Path(args.out) if args.out else Path(args.archives) / args.suite)  # before summarizing
    make_leaderboard(args.output_path, args.suite, out)
    print(f"serve it: helm-server --suite {args.suite} -o {args.output_path}")
    return 0


def cmd_demo(args) -> int:
    from flexgen_helm.tools.report.build import records_dir_of
    from flexgen_helm.tools.report.demo import run_demo

    # every folder the main job writes, ready before helm-run starts
    out = checked_output_dir(Path(args.out) if args.out else Path(args.archives) / args.suite)
    checked_output_dir(args.runs_dir or records_dir_of(out))
    checked_output_dir(args.output_path)
    run_demo(args)
    return 0


def add_command(sub) -> None:
    r = sub.add_parser("report", help="tables and plots from a HELM suite and the bench/eval JSONs under runs/")
    r.add_argument("path", nargs="?", help="a HELM suite folder (e.g. benchmark_output/runs/demo)")
    _common(r)
    r.set_defaults(func=cmd_report)

    lb = sub.add_parser("leaderboard", help="helm-summarize a suite with the plugin's schema, then a screenshot of "
                                             "helm-server's Leaderboard page (needs Chromium) beside its report")
    lb.add_argument("--suite", default="demo", help="HELM suite name")
    lb.add_argument("--output-path", default="benchmark_output", help="helm-run's -o (default: benchmark_output)")
    lb.add_argument("--archives", default="runs", help="reports live in <archives>/<suite> (default: runs)")
    lb.add_argument("--out", help="the screenshot's folder (default: <archives>/<suite>, beside the report)")
    lb.set_defaults(func=cmd_leaderboard)

    d = sub.add_parser("demo", help="helm-run the bundled model uncompressed, 8-bit and 4-bit, then the leaderboard "
                                    "and the report")
    _common(d, suite_default="demo")
    d.add_argument("--max-instances", "-m", type=int, default=10, help="instances per HELM scenario")
    d.add_argument("--threads", "-n", type=int, default=2, help="helm-run threads")
    d.add_argument("--bench", action="store_true", help="also a short bench sweep (frontier, breakdown)")
    d.set_defaults(func=cmd_demo)


def _common(p: argparse.ArgumentParser, suite_default: str | None = None) -> None:
    p.add_argument("--suite", default=suite_default, help="HELM suite name")
    p.add_argument("--output-path", default="benchmark_output", help="helm-run's -o (default: benchmark_output)")
    p.add_argument("--runs-dir", help="the bench / eval JSON records of this report (default: the suite's own, "
                                      "<out>/records, where `demo --bench` writes them)")
    p.add_argument("--archives", default="runs", help="where archived results live; linked, not merged "
                                                      "(default: runs)")
    p.add_argument("--out", help="report folder (default: <archives>/<suite>)")
