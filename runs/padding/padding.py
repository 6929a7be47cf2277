"""Padding efficiency and engine time of HELM runs, as `flexgen-helm demo` makes them.

    PYTHONPATH=. python runs/padding/padding.py --work /tmp/pad --label after
    PYTHONPATH=. python runs/padding/padding.py --work /tmp/pad300 --label after-300 -m 150 \\
        --scenarios lambada synthetic_reasoning:mode=pattern_match --deployments flexgen/smollm2-135m

helm-run with the BatchingRunner and the demo's environment (flexgen_helm/tools/report/demo.py),
fresh output and cache folders, on the main job's scenarios (LAMBADA, WikiText by paragraph,
synthetic_reasoning) plus the paper's other HELM sub-scenario that runs offline
(synthetic_reasoning_natural), for both demo deployments by default. Per run: requests,
batches, real and padded tokens (prompt and output), efficiency = real / padded (the paper's
Table 25 figure) and the engine's time, read from HELM's output as `flexgen-helm report`
reads it. `--client-args '{"max_batch_share": 1}'` runs the deployments with those client args
added (a prod_env model_deployments.yaml beside the run), to compare settings.

Writes results.json beside this file under --label, with the command, the flexgen_helm code
it ran (its folder and git commit: run it with PYTHONPATH=<another checkout> for a before/after)
and the load average before and after. Engine times measured on a shared machine are
indicative only. `--table` prints every measurement of results.json as markdown (README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

import flexgen_helm
from flexgen_helm.tools.report.demo import DEPLOYMENTS, FP16_POLICY, SCENARIOS, helm_command, run_entries
from flexgen_helm.tools.report.helm_runs import helm_table, suite_total

HERE = Path(__file__).resolve().parent
# the paper's HELM sub-scenarios (scenarios/paper_table22.conf) that need no download
OFFLINE_PAPER_SCENARIOS = ("synthetic_reasoning:mode=pattern_match", "synthetic_reasoning_natural:difficulty=easy")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SHOWN = ["scenario", "deployment", "requests", "batches", "prompt tok", "prompt tok (padded)", "output tok",
         "output tok (padded)", "efficiency", "engine time (s)"]


def code_version() -> dict:
    root = Path(flexgen_helm.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"flexgen_helm": str(root), "commit": commit.stdout.strip() or None}


def deployments_with_args(names: list[str], client_args: dict) -> str:
    """A prod_env model_deployments.yaml: the plugin's entries of `names`, with client args added
    (a prod_env entry of the same name wins over the plugin's)."""
    shipped = yaml.safe_load((Path(flexgen_helm.__file__).parent / "helm" / "model_deployments.yaml").read_text())
    chosen = [d for d in shipped["model_deployments"] if d["name"] in names]
    for d in chosen:
        d["client_spec"]["args"].update(client_args)
    return yaml.safe_dump({"model_deployments": chosen}, sort_keys=False)


def measure(work: Path, scenarios: list[str], deployments: list[str], instances: int, threads: int,
            client_args: dict) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    local = work / "prod_env"
    local.mkdir(parents=True)
    if client_args:
        (local / "model_deployments.yaml").write_text(deployments_with_args(deployments, client_args))
    cmd = helm_command(run_entries(scenarios, deployments), instances, "padding", str(work / "out"), threads,
                       local_path=str(local))
    env = {**os.environ, **OFFLINE}
    env.setdefault("FLEXGEN_HELM_POLICY", json.dumps(FP16_POLICY))
    code = code_version()  # before the run: what it ran
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with open(work / "helm-run.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc:
        raise SystemExit(f"helm-run failed (rc {rc}); see {work / 'helm-run.log'}")
    df = helm_table(work / "out" / "runs" / "padding")
    return {"helm_run": cmd, "client_args": client_args, "code": code,
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "wall_s": round(wall, 1),
            "runs": df[[c for c in SHOWN if c in df]].to_dict(orient="records"),
            "whole_job": suite_total(df), "lowest_efficiency": float(df["efficiency"].min())}


def markdown(results: dict) -> str:
    """One table per measurement of results.json."""
    out = []
    for label, r in results.items():
        load = "/".join(f"{r[k][0]:.1f}" for k in ("load_average_before", "load_average_after"))
        out += [f"### {label}", "",
                f"flexgen_helm at {r['code']['commit']}, client args {r['client_args'] or 'as shipped'}, "
                f"load average (1 min) {load} before/after, helm-run wall time {r['wall_s']} s", "",
                "| " + " | ".join(SHOWN) + " |", "|" + "---|" * len(SHOWN)]
        for row in r["runs"]:
            out.append("| " + " | ".join(_cell(row.get(c)) for c in SHOWN) + " |")
        whole = r["whole_job"]
        out += ["", f"Whole job: efficiency {whole['efficiency']:.4f}, engine time {whole['engine time (s)']:.1f} s; "
                    f"lowest efficiency {r['lowest_efficiency']:.4f}", ""]
    return "\n".join(out)


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/flexgen-padding"))
    ap.add_argument("--label", help="the key of this measurement in results.json")
    ap.add_argument("--results", type=Path, default=HERE / "results.json")
    ap.add_argument("-m", "--max-instances", type=int, default=10, help="instances per scenario")
    ap.add_argument("-n", "--threads", type=int, default=2, help="helm-run threads (the demo's default)")
    ap.add_argument("--scenarios", nargs="+",
                    default=list(dict.fromkeys([*SCENARIOS, *OFFLINE_PAPER_SCENARIOS])))
    ap.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS))
    ap.add_argument("--client-args", type=json.loads, default={}, help="JSON: client args added to the deployments")
    ap.add_argument("--table", action="store_true", help="print results.json as markdown tables, measure nothing")
    args = ap.parse_args()
    if args.table:
        print(markdown(json.loads(args.results.read_text())))
        return
    if not args.label:
        ap.error("--label is required to measure")
    result = measure(args.work, args.scenarios, args.deployments, args.max_instances, args.threads, args.client_args)
    result["command"] = [Path(sys.executable).name, *sys.argv]
    print(json.dumps(result, indent=1))
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    results[args.label] = result
    args.results.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
