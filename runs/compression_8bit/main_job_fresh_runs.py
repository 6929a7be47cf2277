"""The README main job run N times, each in a fresh folder (HELM's cache empty, so every request
is computed), and each compressed deployment's actual tok/s over the plain deployment's of the
same run and scenario: the median and range of those ratios, with the median prefill and
decode seconds (issue 48's goal).

    python runs/compression_8bit/main_job_fresh_runs.py [--runs 5] [--out DIR]

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

HERE = Path(__file__).resolve().parent
DEMO = ["flexgen-helm", "demo", "-m", "10"]


def run_once(out: Path, i: int) -> float:
    """One fresh main job; its table copied to out/run{i}.csv. Returns the load before it."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="main-job-") as folder:
        done = subprocess.run(DEMO, cwd=folder, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"run {i}: `{' '.join(DEMO)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
        table = Path(folder) / "runs" / "demo" / "helm_runs.csv"
        shutil.copy(table, out / f"run{i}.csv")
        (out / f"run{i}.log").write_text(done.stderr[-20000:])
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
    args = p.parse_args()
    out = args.out or HERE / f"main_job_fresh_{datetime.date.today().isoformat()}"
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = [round(run_once(out, i), 2) for i in range(1, args.runs + 1)]
    rows = ratios(out, args.runs)
    lines = [f"{r['scenario']:<40} {r['precision']:<22} median {r['ratio_median']:.2f} "
             f"({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})  prefill {r['prefill_s_median']:.2f}s "
             f"decode {r['decode_s_median']:.2f}s" for r in rows]
    (out / "ratios.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    summary = {"host": machine_label(), "started": started, "runs": args.runs, "loadavg_1m_before": loads,
               "command": f"python runs/compression_8bit/main_job_fresh_runs.py --runs {args.runs} --out {out}",
               "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
