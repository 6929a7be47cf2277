"""One row per HELM run of a suite: the precision it ran at, tokens real and padded, engine
time, padded and actual throughput, efficiency (the paper's Table 25), next to the run's
main metrics.

Reads what helm-run writes under <output_path>/runs/<suite>/<run>/: run_spec.json (name,
deployment), scenario_state.json (our per-request `finish_reason["flexgen"]` records, see
flexgen_helm.helm.accounting) and stats.json (HELM's metric means).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from flexgen_helm.helm import accounting
from flexgen_helm.policy.precision import setting_rank

# The metrics that say how good a run was, in the order shown; a run shows those it has
# (generation scenarios: exact-match family; language modeling: perplexity family).
MAIN_METRICS = ("exact_match", "quasi_exact_match", "prefix_exact_match", "quasi_prefix_exact_match",
                "perplexity", "bits_per_byte", "logprob_per_byte")


def run_dirs(suite_dir: Path) -> list[Path]:
    """HELM run folders (those with a run_spec.json); eval_cache and the like are skipped."""
    return sorted(p for p in suite_dir.iterdir() if (p / "run_spec.json").is_file())


def scenario_name(run_name: str) -> str:
    """"wikitext:unit=paragraph,model=flexgen_x" -> "wikitext:unit=paragraph" (the model is a column)."""
    head, _, args = run_name.partition(":")
    kept = [a for a in args.split(",") if a and not a.startswith("model=")]
    return head + (":" + ",".join(kept) if kept else "")


def main_metrics(stats: list[dict], split: str = "test") -> dict[str, float]:
    """Means of MAIN_METRICS on `split`, unperturbed (HELM also stores robustness variants)."""
    found = {}
    for entry in stats:
        name = entry.get("name", {})
        if name.get("perturbation") or name.get("split") != split or name.get("sub_split"):
            continue
        if name.get("name") in MAIN_METRICS and entry.get("count"):
            found[name["name"]] = entry.get("mean")
    return {m: found[m] for m in MAIN_METRICS if m in found}


def read_run(run_dir: Path) -> dict:
    spec = json.loads((run_dir / "run_spec.json").read_text())
    row = {"run": spec["name"], "scenario": scenario_name(spec["name"]),
           "deployment": spec.get("adapter_spec", {}).get("model_deployment")}
    state_path = run_dir / "scenario_state.json"
    if state_path.is_file():
        state = json.loads(state_path.read_text())
        ids = {rs["instance"].get("id") for rs in state.get("request_states", [])}
        row["instances"] = len(ids)
        row["precision"] = accounting.precision_from_scenario_state(state)
        row.update(accounting.summarize(accounting.records_from_scenario_state(state)))
    stats_path = run_dir / "stats.json"
    if stats_path.is_file():
        metrics = main_metrics(json.loads(stats_path.read_text()))
        row.update({f"metric:{k}": v for k, v in metrics.items()})
    return row


# accounting.summarize's keys -> the report's column names (units in the names)
COLUMNS = {
    "scenario": "scenario", "deployment": "deployment", "precision": "precision", "instances": "instances",
    "requests": "requests", "batches": "batches",  # computed in this run
    "prompt_tokens": "prompt tok", "padded_prompt_tokens": "prompt tok (padded)",
    "computed_prompt_tokens": "prompt tok (computed)", "prefix_reuse": "prefix reuse",
    "generated_tokens": "output tok", "padded_generated_tokens": "output tok (padded)",
    "engine_time_s": "engine time (s)", "prefill_s": "prefill (s)", "decode_s": "decode (s)",
    "padded_throughput_tok_s": "padded tok/s", "actual_throughput_tok_s": "actual tok/s",
    "efficiency": "efficiency",
    # the loading of the engines that computed the run's requests, outside every time above
    "engine_load_s": "engine load (s)", "engines": "engines",
    # HELM's cache answered these: counted apart, in none of the columns above (accounting.summarize)
    "cached_requests": "cached requests", "cached_computed": "cached computed",
}


def helm_table(suite_dir: Path) -> pd.DataFrame:
    """The per-run table; metric columns are named "metric:<name>"."""
    rows = [read_run(d) for d in run_dirs(suite_dir)] if suite_dir.is_dir() else []
    if not rows:
        return pd.DataFrame(columns=list(COLUMNS.values()))
    df = pd.DataFrame(rows)
    metric_cols = [c for c in df.columns if c.startswith("metric:")]
    keep = [c for c in COLUMNS if c in df.columns]
    df = df[keep + metric_cols].rename(columns=COLUMNS)
    if "precision" in df:
        df["precision"] = df["precision"].fillna(accounting.PRECISION_NOT_RECORDED)  # a run without its state
    # within a scenario: uncompressed, 8-bit, 4-bit (the paper's order), then by name
    rank = df["precision"].map(setting_rank) if "precision" in df else 0
    keys = df.assign(rank=rank).sort_values(["scenario", "rank", "deployment"], kind="stable")
    return df.loc[keys.index].reset_index(drop=True)


def suite_total(df: pd.DataFrame) -> dict:
    """The whole suite as one run: token sums over engine time (not a mean of ratios)."""
    if df.empty or "engine time (s)" not in df:
        return {}
    t = df["engine time (s)"].sum()
    actual = df["prompt tok"].sum() + df["output tok"].sum()
    padded = df["prompt tok (padded)"].sum() + df["output tok (padded)"].sum()
    total = {"engine time (s)": t, "padded tok/s": padded / t if t else None,
             "actual tok/s": actual / t if t else None, "efficiency": actual / padded if padded else None}
    loads = engine_loads(df)
    if loads:
        total["engines loaded"] = len(loads)
        total["engine load (s)"] = sum(loads.values())
    return total


def engine_loads(df: pd.DataFrame) -> dict[str, float]:
    """The engines that computed the table's runs, each once (one serves every scenario of
    its deployment in a helm-run), and their load seconds."""
    loads = {}
    for cell in df["engines"].dropna() if "engines" in df else ():
        for entry in cell.split():
            engine, _, seconds = entry.rpartition(":")
            loads[engine] = float(seconds)
    return loads
