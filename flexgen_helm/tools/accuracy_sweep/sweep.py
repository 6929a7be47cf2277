"""The accuracy table in runs/accuracy/: which runs make it, running the missing ones, and
the report built from their JSON records (no number is typed by hand).

    python -m flexgen_helm.tools.accuracy_sweep.sweep run [--rows ROW ...] [--scopes lim full] [--dry-run]
    python -m flexgen_helm.tools.accuracy_sweep.sweep report

Each run is one `flexgen-helm eval` command writing runs/accuracy/json/ROW__SCOPE__TASK.json;
`run` skips runs whose JSON exists, and a run stopped midway resumes from the chunks its
JSON.partial.jsonl holds (evaluation/resume.py), so an interrupted sweep loses little.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from flexgen_helm.evaluation.run import TASKS
from flexgen_helm.tools.accuracy_sweep.plan import OUT, PLAN, ROW_BY_NAME, SCOPES, command, json_path
from flexgen_helm.tools.accuracy_sweep.report import write_report


def run(rows: list[str] | None, scopes: list[str] | None, tasks: list[str] | None, dry_run: bool) -> list[str]:
    """The plan's missing runs, in the order of `rows` when given (to run first what matters);
    a run that fails does not stop the others. Returns the commands that failed."""
    failed = []
    plan = sorted((rs for rs in PLAN if rs[0] in rows), key=lambda rs: rows.index(rs[0])) if rows else PLAN
    for name, scope in plan:
        if (rows and name not in rows) or (scopes and scope not in scopes):
            continue
        for task in tasks or TASKS:
            if json_path(name, scope, task).exists():
                continue
            argv = command(ROW_BY_NAME[name], scope, task)
            print("flexgen-helm " + " ".join(argv), flush=True)
            if not dry_run and subprocess.run([sys.executable, "-m", "flexgen_helm", *argv]).returncode != 0:
                failed.append("flexgen-helm " + " ".join(argv))
    return failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.accuracy_sweep.sweep", description=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run the missing runs of the plan")
    r.add_argument("--rows", nargs="*", choices=list(ROW_BY_NAME))
    r.add_argument("--scopes", nargs="*", choices=list(SCOPES))
    r.add_argument("--tasks", nargs="*", choices=list(TASKS))
    r.add_argument("--dry-run", action="store_true")
    sub.add_parser("report", help="write runs/accuracy/results.csv and README.md from the JSON records")
    args = p.parse_args(argv)
    if args.what == "run":
        failed = run(args.rows, args.scopes, args.tasks, args.dry_run)
        if failed:
            print(f"{len(failed)} run(s) failed (their output is above):\n" + "\n".join(failed), file=sys.stderr)
            return 1
    else:
        write_report(OUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
