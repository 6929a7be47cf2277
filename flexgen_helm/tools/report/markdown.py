"""Markdown tables without `tabulate` (pandas' to_markdown needs it; a pipe table is a
few lines), with numbers rounded for reading; the CSV beside each table keeps them all."""

from __future__ import annotations

import math

import pandas as pd


def fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.1f}"
        # small seconds read better as 0.017 than 1.738e-02
        return f"{value:.3f}" if abs(value) < 0.01 else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(df: pd.DataFrame) -> str:
    if df.empty:
        return "_(no data)_\n"
    cols = [str(c) for c in df.columns]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(fmt(_py(v)) for v in row) + " |")
    return "\n".join(lines) + "\n"


def _py(v):
    """numpy scalars -> Python ones, so that fmt's int/float checks work."""
    return v.item() if hasattr(v, "item") else v
