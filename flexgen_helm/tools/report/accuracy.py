"""Accuracy under approximations, like the paper's Table 5 (LAMBADA accuracy, WikiText
perplexity for FP16 vs 4-bit, 8-bit, 4-bit-S), from two sources:

  * `flexgen-helm eval` records (runs/**/*.json with task/metrics/policy; see
    flexgen_helm/evaluation/run.py), one row per setting and data scope;
  * HELM runs of the suite, one row per deployment (e.g. flexgen/smollm2-135m vs -4bit).
"""

from __future__ import annotations

import pandas as pd

from flexgen_helm.evaluation.run import approximations
from flexgen_helm.policy.precision import setting_name, setting_rank

# Which HELM metrics answer "how accurate" for a scenario (run name before ":").
PRIMARY = {"lambada": ("prefix_exact_match",), "wikitext": ("perplexity", "bits_per_byte")}
DEFAULT_PRIMARY = ("exact_match",)


def eval_table(records: list[dict]) -> pd.DataFrame:
    """One row per (setting, scope): LAMBADA accuracy, WikiText perplexity and bits/byte.

    Scope is "full" or "subset" (a --limit run), so that a row pairs like with like; of
    several records for one cell, the one over the most data wins."""
    best: dict[tuple, dict] = {}
    for r in records:
        policy = r["policy"]
        scope = "full" if not r.get("limit") else "subset"
        key = (setting_name(policy, r.get("dtype", "")), approximations(policy), r.get("model", ""), scope)
        if (key, r["task"]) not in best or _size(r) > _size(best[key, r["task"]]):
            best[key, r["task"]] = r
    rows: dict[tuple, dict] = {}
    for (key, task), r in best.items():
        row = rows.setdefault(key, dict(zip(("setting", "approximations", "model", "scope"), key)))
        m, c = r["metrics"], r.get("counts", {})
        if task == "lambada":
            row.update({"LAMBADA acc": m.get("accuracy"), "LAMBADA passages": c.get("passages")})
        elif task == "wikitext":
            row.update({"WikiText ppl": m.get("token_perplexity"), "WikiText bits/byte": m.get("bits_per_byte"),
                        "WikiText tokens": c.get("tokens")})
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(list(rows.values()))
    df = df.sort_values(["scope", "setting"], key=lambda c: c.map(setting_rank) if c.name == "setting" else c,
                        kind="stable")
    return df.reset_index(drop=True)


def _size(r: dict) -> int:
    c = r.get("counts", {})
    return c.get("passages") or c.get("tokens") or 0


def primary_metrics(scenario: str) -> tuple[str, ...]:
    return PRIMARY.get(scenario.split(":")[0], DEFAULT_PRIMARY)


def helm_accuracy_table(helm: pd.DataFrame) -> pd.DataFrame:
    """Rows: deployments, with the precision their runs recorded; columns: "<scenario>
    <metric>" for each scenario's primary metrics."""
    if helm.empty:
        return pd.DataFrame()
    cells: dict[str, dict[str, float]] = {}
    for _, run in helm.iterrows():
        for metric in primary_metrics(run["scenario"]):
            value = run.get(f"metric:{metric}")
            if value is not None and not pd.isna(value):
                cells.setdefault(run["deployment"], {})[f"{run['scenario']} {metric}"] = value
    if not cells:
        return pd.DataFrame()
    df = pd.DataFrame.from_dict(cells, orient="index")
    df = df[sorted(df.columns)]
    df.index.name = "deployment"
    if "precision" not in helm:
        return df.reset_index()
    precision = helm.groupby("deployment")["precision"].agg(lambda p: " + ".join(sorted(set(p))))
    df.insert(0, "precision", precision.reindex(df.index))
    return df.reset_index().sort_values("precision", key=lambda c: c.map(setting_rank), kind="stable",
                                        ignore_index=True)
