"""The README main job run N times, each in a fresh folder (HELM's cache empty, so every request
is computed), and each compressed deployment's actual tok/s over the plain deployment's of the
same run and scenario: the median and range of those ratios, with the median prefill and
decode seconds (issue 48's goal).

    python runs/compression_8bit/main_job_fresh_runs.py [--runs 5] [--out DIR] [--interleaved]

--interleaved: the job's runs, but scenario by scenario (each scenario's three deployments back
to back), the deployments' order rotated from run to run (then `flexgen-helm report`, which
writes the same table). The job itself runs FP32's scenarios, then 8-bit's, then 4-bit's: on a
host whose speed drifts within minutes, a fixed order measures the drift as much as the
deployments (main_job_fresh_2026-11-27_kivi_rounded/README.md); adjacent and rotated, it cancels.

Writes runN.csv (the run's runs/demo/helm_runs.csv), ratios.txt and summary.json (the host,
the load average before each run, the command) into --out (default: a folder named for the
date beside this file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from flexgen_helm.memory.machine import machine_label
from flexgen_helm.tools.report.demo import DEPLOYMENTS, SCENARIOS, helm_command, run_entries

HERE = Path(__file__).resolve().parent
DEMO = ["flexgen-helm", "demo", "-m", "10"]


def interleaved_commands(i: int) -> list[list[str]]:
    """Run i's commands for --interleaved: helm-run with each scenario's deployments back to
    back, their order rotated by i, then the report of the suite."""
    order = DEPLOYMENTS[i % len(DEPLOYMENTS):] + DEPLOYMENTS[:i % len(DEPLOYMENTS)]
    entries = [e for s in SCENARIOS for e in run_entries((s,), order)]
    return [helm_command(entries, 10, "demo", "benchmark_output", 2), ["flexgen-helm", "report", "--suite", "demo"]]


def run_once(out: Path, i: int, commands: list[list[str]]) -> float:
    """One fresh main job; its table copied to out/run{i}.csv. Returns the load before it."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="main-job-") as folder:
        log = []
        for cmd in commands:
            done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
            log.append(f"+ {' '.join(cmd)}\n{done.stderr[-20000:]}")
            if done.returncode:
                sys.exit(f"run {i}: `{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
        table = Path(folder) / "runs" / "demo" / "helm_runs.csv"
        shutil.copy(table, out / f"run{i}.csv")
        (out / f"run{i}.log").write_text("\n".join(log))
    return load


def ratios(out: Path, runs: int) -> list[dict]:
    """Per scenario and deployment: actual tok/s over the plain deployment's, run by run."""
    tables = [pd.read_csv(out / f"run{i}.csv") for i in range(1, runs + 1)]
    rows = []
    for (scenario, deployment), _ in tables[0].groupby(["scenario", "deployment"]):
        per_run, prefill, decode = [], [], []
        for t in tables:
            of_scenario = t[t.scenario == scenario]
            plain = of_scenario[~of_scenario.deployment.str.contains("bit")]["actual tok/s"]
            if plain.empty:
                sys.exit(f"{scenario}: no uncompressed deployment in the run to divide by")
            plain = plain.iloc[0]
            mine = of_scenario[of_scenario.deployment == deployment].iloc[0]
            if mine["cached requests"]:
                sys.exit(f"{scenario} {deployment}: {mine['cached requests']} requests came from HELM's cache")
            per_run.append(mine["actual tok/s"] / plain)
            prefill.append(mine["prefill (s)"])
            decode.append(mine["decode (s)"])
        precision = tables[0][(tables[0].scenario == scenario) & (tables[0].deployment == deployment)].precision.iloc[0]
        rows.append({"scenario": scenario, "deployment": deployment, "precision": precision,
                     "ratio_median": round(statistics.median(per_run), 3),
                     "ratio_range": [round(min(per_run), 3), round(max(per_run), 3)],
                     "ratios": [round(r, 3) for r in per_run],
                     "prefill_s_median": round(statistics.median(prefill), 3),
                     "decode_s_median": round(statistics.median(decode), 3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--interleaved", action="store_true",
                   help="each scenario's deployments back to back, their order rotated run by run")
    args = p.parse_args()
    out = args.out or HERE / f"main_job_fresh_{datetime.date.today().isoformat()}"
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = [round(run_once(out, i, interleaved_commands(i) if args.interleaved else [DEMO]), 2)
             for i in range(1, args.runs + 1)]
    rows = ratios(out, args.runs)
    lines = [f"{r['scenario']:<40} {r['precision']:<22} median {r['ratio_median']:.2f} "
             f"({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})  prefill {r['prefill_s_median']:.2f}s "
             f"decode {r['decode_s_median']:.2f}s" for r in rows]
    (out / "ratios.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    summary = {"host": machine_label(), "started": started, "runs": args.runs, "loadavg_1m_before": loads,
               "command": f"python runs/compression_8bit/main_job_fresh_runs.py --runs {args.runs} --out {out}"
                          + (" --interleaved" if args.interleaved else ""),
               "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
