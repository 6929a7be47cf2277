"""Latency-throughput points from bench records, one curve per system / setting (the
paper's Figure 1), and the ablation table (Table 6 of the paper: each optimization off).

A point is one `flexgen-helm bench` (or policy-validation) record; its curve is the
record's `--label` if it has one, else a short description of its policy without the
block shape, so that the same setting at several batch sizes makes one curve. Records of
different hosts, models or workloads (prompt / output lengths) are never compared on one
plot: each (host, model, workload) is a group of its own.
"""

from __future__ import annotations

import pandas as pd

from flexgen_helm.evaluation.run import approximations
from flexgen_helm.tools.report.records import host_of

# The paper's ablation rows, matched against bench labels (case and -/_ ignored).
ABLATION = ("all optimizations", "no policy search", "no overlap", "no CPU compute", "no disk",
            "DeepSpeed-style policy")


def _pct(split: dict) -> str:
    return "/".join(f"{100 * split[t]:g}" for t in ("gpu", "cpu", "disk"))


def setting_of(r: dict) -> str:
    if r.get("label"):
        return str(r["label"])
    p = r["policy"]
    parts = [f"W{_pct(p['weights'])} C{_pct(p['cache'])} A{_pct(p['activations'])}"]
    if approximations(p) != "none":
        parts.append(approximations(p))
    if not p.get("overlap", True):
        parts.append("no overlap")
    if p.get("cpu_cache_compute"):
        parts.append("CPU attention")
    return ", ".join(parts)


def batch_of(r: dict) -> int:
    p = r["policy"]
    return int(r.get("effective_batch_size") or r.get("block_size") or p["gpu_batch_size"] * p["num_gpu_batches"])


GROUP = ["host", "model", "workload"]


def workload_of(r: dict) -> str:
    return f"prompt {r.get('prompt_len')} / output {r.get('gen_len')}"


def frontier_table(records: list[dict]) -> pd.DataFrame:
    """One row per record: its group (host, model, workload), curve (setting) and point."""
    rows = [{"host": host_of(r), "model": r.get("model", "model not recorded"), "workload": workload_of(r),
             "curve": setting_of(r), "batch": batch_of(r), "prompt_len": r.get("prompt_len"),
             "gen_len": r.get("gen_len"), "latency (s)": r["total_latency_s"],
             "throughput (tok/s)": r["total_throughput"], "source": r.get("_path", "")} for r in records]
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    return df.sort_values([*GROUP, "curve", "batch"], kind="stable").reset_index(drop=True)


def frontier_groups(df: pd.DataFrame) -> list[tuple[tuple[str, str, str], pd.DataFrame]]:
    """The table cut into its (host, model, workload) groups, each a plot of its own."""
    if df.empty:
        return []
    return [(key, g.reset_index(drop=True)) for key, g in df.groupby(GROUP, sort=False)]


def _norm(label: str) -> str:
    return " ".join(str(label).lower().replace("-", " ").replace("_", " ").split())


def ablation_name(label: str | None) -> str | None:
    """The ablation row a bench label names: "no disk (weights in RAM only)" -> "no disk"."""
    label = _norm(label or "")
    return next((a for a in ABLATION if label == _norm(a) or label.startswith(_norm(a) + " ")), None)


def ablation_table(records: list[dict]) -> pd.DataFrame:
    """One row per workload (model, lengths) and ablation setting present: its best
    throughput (the paper reports each setting at its best batch size) and the ratio to
    "all optimizations" of the same workload."""
    best: dict[tuple, dict] = {}
    for r in records:
        name = ablation_name(r.get("label"))
        if name is None:
            continue
        key = (f"{r.get('model')} s={r.get('prompt_len')} n={r.get('gen_len')}, {host_of(r)}", name)
        if key not in best or r["total_throughput"] > best[key]["total_throughput"]:
            best[key] = r
    if not best:
        return pd.DataFrame()
    rows = []
    for workload in dict.fromkeys(w for w, _ in best):
        base = best.get((workload, "all optimizations"), {}).get("total_throughput")
        for name in ABLATION:
            r = best.get((workload, name))
            if r is None:
                continue
            rows.append({"workload": workload, "setting": name, "label": r.get("label"),
                         "policy": r.get("policy_summary", ""), "batch": batch_of(r),
                         "throughput (tok/s)": r["total_throughput"], "latency (s)": r["total_latency_s"],
                         "vs all optimizations": r["total_throughput"] / base if base else None})
    return pd.DataFrame(rows)
