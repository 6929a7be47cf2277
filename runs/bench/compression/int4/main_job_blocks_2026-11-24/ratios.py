"""Print the README's tables from the per-run records in this folder.

Usage: python ratios.py [final|first_cut_ddad695] [--eval eval_final]

A demo folder holds `{before,after}-N.csv`, each runs/demo/helm_runs.csv of one
`flexgen-helm demo -m 10` run. An eval folder holds `eval-{before,after}-N.json`, each the
record of one `flexgen-helm eval --task lambada --limit 500 --dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
SIDES = ("before", "after")


def _runs(folder: Path) -> pd.DataFrame:
    frames = []
    for path in sorted(folder.glob("*-*.csv")):
        side, round_ = path.stem.split("-")
        frame = pd.read_csv(path)
        frame["side"], frame["round"] = side, int(round_)
        frames.append(frame)
    runs = pd.concat(frames)
    runs["scenario"] = runs["scenario"].str.split(":").str[0]
    return runs


def _ratio_table(runs: pd.DataFrame) -> pd.DataFrame:
    """4-bit over BF16 actual token/s, per scenario, side and round."""
    tok_s = runs.pivot_table(index=["round", "scenario", "side"], columns="precision",
                             values="actual tok/s")
    ratio = (tok_s["4-bit"] / tok_s["BF16"]).round(2)
    return ratio.unstack(["scenario", "side"]).sort_index(axis=1)


def _ranges(runs: pd.DataFrame, column: str) -> pd.DataFrame:
    """min-max of a column per deployment and scenario, before -> after."""
    spans = runs.groupby(["precision", "scenario", "side"])[column].agg(["min", "max"])
    text = spans.apply(lambda r: f"{r['min']:.2f}-{r['max']:.2f}", axis=1)
    return text.unstack("side")[list(SIDES)]


def _eval_table(folder: Path) -> pd.DataFrame:
    rows = []
    for path in sorted(folder.glob("eval-*-*.json")):
        _, side, round_ = path.stem.split("-")
        record = json.loads(path.read_text())
        policy = record["policy"]
        rows.append({"side": side, "round": int(round_), "eval_s": round(record["eval_s"], 1),
                     "block": f"{policy['gpu_batch_size']} x {policy['num_gpu_batches']}",
                     "accuracy": record["metrics"]["accuracy"]})
    return pd.DataFrame(rows).pivot(index="round", columns="side")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", nargs="?", default="final")
    parser.add_argument("--eval", default=None, help="an eval A/B folder to summarise too")
    args = parser.parse_args()
    runs = _runs(HERE / args.demo)
    pd.set_option("display.width", 200)
    print("4-bit / BF16 actual token/s\n", _ratio_table(runs), "\n")
    print("engine time (s)\n", _ranges(runs, "engine time (s)"), "\n")
    print("batches\n", _ranges(runs, "batches"), "\n")
    print("efficiency\n", _ranges(runs, "efficiency"), "\n")
    if args.eval:
        print("eval LAMBADA 500 bf16\n", _eval_table(HERE / args.eval))


if __name__ == "__main__":
    main()
