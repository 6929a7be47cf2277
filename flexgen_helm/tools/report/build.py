"""`flexgen-helm report`: read a HELM suite's output and the JSON records of the same run,
write <out>/report.md with its tables (each also as CSV) and PNG plots beside it.

    flexgen-helm report --suite demo                     # benchmark_output/runs/demo -> runs/demo
    flexgen-helm report benchmark_output/runs/demo       # the same, by path
    flexgen-helm report --runs-dir runs/engine/json --out runs/engine/report   # bench records alone

A suite's report is about that run: its HELM runs and the bench / eval records in its own
folder (<out>/records, where `flexgen-helm demo --bench` writes them). Results archived
elsewhere under runs/ (other hosts, other days) are linked with their host and date, never
merged into this run's tables. Each section says which command fills it when empty.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pandas as pd

from flexgen_helm.memory.machine import machine_info, machine_label
from flexgen_helm.policy.precision import setting_rank, weights_meaning
from flexgen_helm.tools.report import (
    accuracy,
    archive,
    breakdown,
    frontier,
    helm_runs,
    leaderboard,
    placement,
    plots,
    records,
)
from flexgen_helm.tools.report.markdown import fmt, table

RUN_INFO = "run_info.json"  # written beside the records by the command that made the run

HELM_SHOWN = ["scenario", "deployment", "precision", "instances", "prompt tok", "prompt tok (padded)",
              "prompt tok (computed)", "prefix reuse", "output tok", "output tok (padded)", "engine time (s)",
              "prefill (s)", "decode (s)", "padded tok/s", "actual tok/s", "efficiency", "engine load (s)",
              "cached requests"]


def suite_path(output_path: str | Path, suite: str) -> Path:
    return Path(output_path) / "runs" / suite


def records_dir_of(out: Path) -> Path:
    """Where a suite's own bench / eval records live: inside its report folder."""
    return out / "records"


def write_run_info(folder: Path, command: list[str]) -> Path:
    """The host, date, command and load average of a run, beside its records, for its report
    (written when the run starts; `end_run_info` adds the load at its end)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = {"hardware": machine_info(), "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": command, "load_average_start": os.getloadavg()}
    path = folder / RUN_INFO
    path.write_text(json.dumps(info, indent=1))
    return path


def end_run_info(folder: Path) -> Path:
    """The run's end and the load average then (others may share the machine: its timings
    are only as good as the machine was idle)."""
    path = folder / RUN_INFO
    info = json.loads(path.read_text())
    info.update(ended=datetime.datetime.now().isoformat(timespec="seconds"), load_average_end=os.getloadavg())
    path.write_text(json.dumps(info, indent=1))
    return path


def build_report(suite_dir: str | Path, records_dir: str | Path | None = None, out: str | Path | None = None,
                 archive_root: str | Path = "runs") -> Path:
    """The report of one run: the HELM suite at `suite_dir` and the records in `records_dir`
    (default: the suite's own, <out>/records); archives under `archive_root` are linked."""
    suite_dir = Path(suite_dir)
    out = Path(out) if out else Path(archive_root) / suite_dir.name
    out.mkdir(parents=True, exist_ok=True)
    records_dir = Path(records_dir) if records_dir else records_dir_of(out)
    files = records.load_json_files(records_dir)
    benches, evals = records.bench_records(files), records.eval_records(files)

    md = [f"# Report: suite `{suite_dir.name}`\n", _provenance(suite_dir, records_dir, benches, evals)]
    helm = helm_runs.helm_table(suite_dir)
    md += leaderboard.leaderboard_section(suite_dir, out)
    md += _helm_section(helm, suite_dir, out)
    md += _accuracy_section(evals, helm, out)
    md += _frontier_section(benches, out)
    md += _breakdown_section(benches, out)
    md += _placement_section(benches, out)
    md += _ablation_section(benches, out)
    md += archive.archive_section(Path(archive_root), out)
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def _provenance(suite_dir: Path, records_dir: Path, benches: list[dict], evals: list[dict]) -> str:
    info_path = records_dir / RUN_INFO
    if info_path.exists():
        info = json.loads(info_path.read_text())
        ran = (f"Measured on **{machine_label(info['hardware'])}**, started {info['started']} by "
               f"`{' '.join(info['command'])}`. {_load_note(info)}")
    else:
        ran = (f"The run recorded no host; this report was built on {machine_label()} "
               f"on {datetime.datetime.now():%Y-%m-%d %H:%M}.")
    return (f"{ran} Sources: HELM's output `{suite_dir}` and {len(benches)} bench / {len(evals)} eval records "
            f"in `{records_dir}`; every table is also a CSV beside this file, every figure is drawn from the "
            "table above it.\n")


def _load_note(info: dict) -> str:
    """The machine's 1-minute load average over the run: every timing of the report was taken under it."""
    if "load_average_start" not in info:
        return "The run recorded no load average: its timings may have shared the machine with other work."
    end = f", {info['load_average_end'][0]:.2f} at its end" if "load_average_end" in info else ""
    return (f"Load average (1 min) {info['load_average_start'][0]:.2f} at its start{end}, on "
            f"{info['hardware'].get('cpu_cores', '?')} cores: every timing below was taken under that load.")


def _csv(df: pd.DataFrame, out: Path, name: str) -> str:
    if df.empty:
        return ""
    df.to_csv(out / name, index=False)
    return f"CSV: [{name}]({name})\n"


def _img(path: Path | None, alt: str) -> str:
    return f"![{alt}]({path.name})\n" if path else ""


def _helm_section(df: pd.DataFrame, suite_dir: Path, out: Path) -> list[str]:
    md = ["## HELM runs: padded vs actual throughput (paper Table 25)\n"]
    if df.empty:
        return md + [f"No HELM runs under `{suite_dir}`: run `helm-run ... --suite {suite_dir.name}` "
                     "or `flexgen-helm demo`.\n"]
    metric_cols = [c for c in df.columns if c.startswith("metric:")]
    shown = df[[c for c in HELM_SHOWN if c in df]].copy()
    # each run's own metrics as text: a generation run has no perplexity column worth a glance
    shown["metrics"] = [", ".join(f"{m}={fmt(run[f'metric:{m}'])}" for m in accuracy.primary_metrics(run["scenario"])
                                  if f"metric:{m}" in run and pd.notna(run[f"metric:{m}"]))
                        for _, run in df.iterrows()]
    total = helm_runs.suite_total(df)
    md += ["Tokens: real ones, as padded (every prompt of a GPU batch left-padded to its longest), and as "
           "computed at prefill (a batch's shared prompt prefix, e.g. few-shot examples, once: prefix reuse is the "
           "share of the padded prompt tokens it saved). "
           "Engine time: the engine's wall time for the run's batches; prefill and decode: the part of it in "
           "each stage (per-stage time: prompts through the model, then one step per generated token). "
           "Padded / actual tok/s = (prompt + output tokens, padded / real) / engine time; "
           "efficiency = actual / padded. Engine load: the time to load the engine that computed the run's "
           "requests (weights read and placed, dense copies made), paid once per deployment per process before "
           "its first batch and in no engine time or throughput; an engine serving several scenarios shows its "
           "load in each of their rows, and the whole-suite line counts it once (data-parallel ranks each load "
           "their own, at the same time: the line adds them up). Requests HELM's cache answered "
           "(computed by an earlier run: a rerun in "
           "the same folder) are counted apart in \"cached requests\" and in no other column: tokens, times and "
           "throughputs are those of the requests this run computed.\n", table(shown)]
    if "cached requests" in df and df["cached requests"].fillna(0).sum():
        md.append("From HELM's cache, not computed in this run: " + "; ".join(
            f"{run['scenario']} / {run['deployment']}: {int(run['cached requests'])} requests, {run['cached computed']}"
            for _, run in df.iterrows() if run["cached requests"]) + ".\n")
    if total:
        md.append("Whole suite: " + ", ".join(f"{k} {fmt(v)}" for k, v in total.items()) + "\n")
    md.append(_csv(df.rename(columns={c: c.removeprefix("metric:") for c in metric_cols}), out, "helm_runs.csv"))
    md.append(_img(plots.helm_throughput(df, out / "helm_throughput.png"), "padded vs actual throughput"))
    return md


def _accuracy_section(evals: list[dict], helm_df: pd.DataFrame, out: Path) -> list[str]:
    md = ["## Accuracy under compression (paper Table 5)\n", "### `flexgen-helm eval`\n"]
    ev = accuracy.eval_table(evals)
    if ev.empty:
        md.append("No eval records in this run: `flexgen-helm eval --task lambada ... --json <records folder>/X.json`; "
                  "the full-set table is archived in runs/accuracy (below).\n")
    else:
        md += ["LAMBADA: last-word accuracy; WikiText: token perplexity and bits per byte. Scope \"subset\": "
               "runs with --limit, compare within a scope.\n", table(ev), _csv(ev, out, "accuracy_eval.csv")]
        label = ev["setting"] + " (" + ev["scope"] + ")"
        md.append(_img(plots.bar_panels(ev.assign(label=label), "label", ["LAMBADA acc", "WikiText ppl",
                                                                          "WikiText bits/byte"],
                                        "Accuracy by setting (flexgen-helm eval)", out / "accuracy_eval.png"),
                       "accuracy by setting"))
    md.append("### HELM runs, per deployment\n")
    helm = accuracy.helm_accuracy_table(helm_df)
    if helm.empty:
        md.append("No HELM metrics for this suite.\n")
    else:
        sizes = sorted({int(n) for n in helm_df["instances"].dropna()}) if "instances" in helm_df else []
        if sizes:
            md.append(f"Each value is a mean over its run's instances ({' / '.join(map(str, sizes))} here; one "
                      "instance moves an accuracy by 1 / that many): HELM's own sample, not the full test set.\n")
        md += [table(helm), _csv(helm, out, "accuracy_helm.csv")]
        if "precision" in helm:  # what a comparison of two rows means for the checkpoint's weights
            shown_precisions = sorted(set(helm["precision"].dropna()), key=setting_rank)
            md.append("Weights each precision computes with: "
                      + "; ".join(f"{p}: {weights_meaning(p)}" for p in shown_precisions) + ".\n")
        named = helm.assign(label=helm["deployment"] + (" (" + helm["precision"] + ")" if "precision" in helm else ""))
        metrics = [c for c in helm.columns if c not in ("deployment", "precision")]
        md.append(_img(plots.bar_panels(named, "label", metrics, "HELM metrics by deployment",
                                        out / "accuracy_helm.png"), "HELM metrics"))
    return md


def _table_section(heading: str, df: pd.DataFrame, if_empty: str, out: Path, name: str, intro: str = "",
                   plot=None, alt: str = "", hide: tuple[str, ...] = ()) -> list[str]:
    """A section of one table: its heading, then the command that fills it when there is no
    data, else the intro, the table (less the `hide` columns), its CSV and, given `plot`, a PNG."""
    md = [f"## {heading}\n"]
    if df.empty:
        return md + [if_empty + "\n"]
    md += [intro + "\n"] if intro else []
    md += [table(df.drop(columns=list(hide))), _csv(df, out, f"{name}.csv")]
    if plot:
        md.append(_img(plot(df, out / f"{name}.png"), alt))
    return md


def _frontier_section(benches: list[dict], out: Path) -> list[str]:
    """One table and one plot per (host, model, workload): a frontier compares settings
    measured on one machine with one model and one workload, nothing else."""
    df = frontier.frontier_table(benches)
    md = ["## Latency-throughput trade-off (paper Figure 1)\n"]
    if df.empty:
        return md + ["No bench records in this run: `flexgen-helm bench ... --label NAME --json "
                     "<records folder>/X.json` at several --gpu-batch-size / --num-gpu-batches, or "
                     "`flexgen-helm demo --bench`.\n"]
    md.append(_csv(df, out, "frontier.csv"))
    for i, ((host, model, workload), group) in enumerate(frontier.frontier_groups(df), start=1):
        md += [f"### {model}, {workload} tokens, on {host}\n",
               table(group.drop(columns=[*frontier.GROUP, "prompt_len", "gen_len"])),
               _img(plots.frontier(group, out / f"frontier-{i}.png"), f"latency-throughput frontier {i}")]
    return md


def _breakdown_section(benches: list[dict], out: Path) -> list[str]:
    return _table_section(
        "Runtime breakdown (paper Table 23)", breakdown.breakdown_table(benches),
        "No bench record has a breakdown: `flexgen-helm bench ... --no-overlap --json runs/bench/X.json`.", out,
        "breakdown", intro="Seconds per stage, timed per kind of event; with overlap off they add up to the stage's "
        "time (other: sampling, softmax, Python), with overlap on transfers ran beside compute.",
        plot=plots.breakdown, alt="breakdown")


def _placement_section(benches: list[dict], out: Path) -> list[str]:
    return _table_section(
        "Placement and memory per tier", placement.placement_table(benches),
        "No bench record carries its memory use: `flexgen-helm bench ... --json runs/bench/X.json`.", out,
        "placement", intro="Weights as placed on each tier (compressed bytes under weight compression). Peak: the "
        "most the engine's bookkeeping held on a tier at once (weight homes on gpu/cpu, KV cache, activations; not "
        "the working copies of the layers in use, nor the weight store on disk). RSS: the whole process.")


def _ablation_section(benches: list[dict], out: Path) -> list[str]:
    return _table_section(
        "Ablation (paper Table 6)", frontier.ablation_table(benches),
        "No labelled ablation runs: bench with `--label` one of "
        + ", ".join(f'"{a}"' for a in frontier.ABLATION) + ".", out, "ablation",
        intro="Each setting at its best measured batch size.")
