"""PNG figures for the report (matplotlib, Agg backend: no display on a server).
Every axis says what it measures and in which unit."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from flexgen_helm.tools.report.breakdown import COLUMNS as BREAKDOWN_COLUMNS


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps legends placed outside the axes
    plt.close(fig)
    return path


def helm_throughput(df: pd.DataFrame, path: Path) -> Path | None:
    """Padded vs actual tokens/s per HELM run (the gap is the padding)."""
    df = df.dropna(subset=["padded tok/s"]) if "padded tok/s" in df else df.iloc[0:0]
    if df.empty:
        return None
    labels = [f"{s}\n{d}" for s, d in zip(df["scenario"], df["deployment"])]
    y = range(len(df))
    fig, ax = plt.subplots(figsize=(8, 1.0 + 0.7 * len(df)))
    h = 0.38
    ax.barh([i - h / 2 for i in y], df["padded tok/s"], h, label="padded")
    ax.barh([i + h / 2 for i in y], df["actual tok/s"], h, label="actual (real tokens)")
    for i, (a, e) in enumerate(zip(df["actual tok/s"], df["efficiency"])):
        ax.annotate(f" {e:.0%}", (a, i + h / 2), va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("throughput (tokens/s: prompt + output tokens / engine time)")
    ax.set_title("HELM runs: padded vs actual throughput (label: efficiency)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return _save(fig, path)


def bar_panels(df: pd.DataFrame, label_col: str, value_cols: list[str], title: str, path: Path) -> Path | None:
    """One panel per metric, one bar per row (settings or deployments)."""
    value_cols = [c for c in value_cols if c in df and df[c].notna().any()]
    if df.empty or not value_cols:
        return None
    ncols = min(2, len(value_cols))
    nrows = -(-len(value_cols) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, nrows * (1.4 + 0.4 * len(df))), squeeze=False)
    labels = df[label_col].astype(str).tolist()
    for ax, col in zip(axes.flat, value_cols):
        values = df[col].astype(float)
        ax.barh(range(len(df)), values.fillna(0.0), color="tab:blue")
        for i, v in enumerate(values):
            if pd.notna(v):
                ax.annotate(f" {v:.3g}", (v, i), va="center", fontsize=8)
        ax.set_yticks(range(len(df)), labels, fontsize=8)
        ax.invert_yaxis()
        top = values.max(skipna=True)
        ax.set_xlim(0, top * 1.25 if top > 0 else 1.0)  # an all-zero score still gets a 0..1 axis
        ax.set_xlabel(col.replace(" ", "\n", 1) if len(col) > 40 else col, fontsize=9)
    for ax in list(axes.flat)[len(value_cols):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def frontier(df: pd.DataFrame, path: Path) -> Path | None:
    """Throughput against latency for one (host, model, workload) group: one line per
    setting, points labelled with the batch."""
    if df.empty:
        return None
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors, markers = plt.get_cmap("tab20").colors, "osD^vPX*"
    for i, (curve, g) in enumerate(df.groupby("curve", sort=False)):
        g = g.sort_values("batch")  # a curve is traced by growing the batch, as in Figure 1
        # colour and marker both vary: many settings stay tellable apart
        ax.plot(g["latency (s)"], g["throughput (tok/s)"], marker=markers[i % len(markers)],
                color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20], label=curve)
        for x, y, b in zip(g["latency (s)"], g["throughput (tok/s)"], g["batch"]):
            ax.annotate(f"bs={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for axis, values in (("x", df["latency (s)"]), ("y", df["throughput (tok/s)"])):
        if values.min() > 0 and values.max() / values.min() > 20:  # spans decades: log scale
            getattr(ax, f"set_{axis}scale")("log")
    if ax.get_xscale() == "linear":  # Figure 1 style: both axes from zero
        ax.set_xlim(left=0)
    if ax.get_yscale() == "linear":
        ax.set_ylim(bottom=0)
    ax.set_xlabel("latency (s per block: prefill + decode)")
    ax.set_ylabel("generation throughput (generated tokens/s)")
    first = df.iloc[0]
    ax.set_title(f"Latency-throughput trade-off: {first['model']}, {first['workload']} tokens\n{first['host']}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def breakdown(df: pd.DataFrame, path: Path) -> Path | None:
    """Stacked seconds per stage and setting: where the time goes."""
    if df.empty:
        return None
    parts = list(BREAKDOWN_COLUMNS) + ["other (s)"]
    labels = [f"{s}, bs={b} [{st}{', overlap' if o else ''}]"
              for s, b, st, o in zip(df["setting"], df["batch"], df["stage"], df["overlap"])]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len(df)))
    left = pd.Series(0.0, index=df.index)
    for col in parts:
        values = df[col].fillna(0.0).clip(lower=0.0)
        ax.barh(range(len(df)), values, left=left, label=col.replace(" (s)", ""))
        left = left + values
    # the stage's measured wall time: the parts reach it without overlap, pass it with
    ax.scatter(df["total (s)"], range(len(df)), marker="|", s=400, color="black", zorder=3, label="stage wall time")
    ax.set_yticks(range(len(df)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title("Runtime breakdown per stage (parts add up only without overlap)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)
