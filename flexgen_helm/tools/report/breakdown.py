"""Runtime breakdown per stage (the paper's Table 23) from bench records that carry
`breakdown` (flexgen_helm.tools.bench.breakdown: seconds per stage and kind of event).

Only with overlap off do the parts add up to the stage's time; with overlap on the
transfers ran beside compute, which the table says in its `overlap` column.
"""

from __future__ import annotations

import pandas as pd

from flexgen_helm.tools.report.frontier import batch_of, setting_of
from flexgen_helm.tools.report.records import host_of

# table column -> the bench breakdown events it sums (activations: hidden states moved
# between layers, which the paper folds into its other columns)
COLUMNS = {
    "compute (s)": ("compute",),
    "weight read (s)": ("load_weight",),
    "cache read (s)": ("load_cache",),
    "cache write (s)": ("store_cache",),
    "activations (s)": ("load_hidden", "store_hidden"),
}


def breakdown_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        if "breakdown" not in r:
            continue
        for stage in ("prefill", "decode"):
            events = r["breakdown"].get(stage, {})
            total = r.get(f"{stage}_latency_s", 0.0)
            row = {"host": host_of(r), "model": r.get("model"), "setting": setting_of(r), "batch": batch_of(r),
                   "stage": stage,
                   "overlap": r["policy"].get("overlap", True), "total (s)": total}
            for col, keys in COLUMNS.items():
                row[col] = sum(events.get(k, 0.0) for k in keys)
            # sampling, the head's softmax, Python: whatever the timed events leave (only
            # meaningful when the events ran one after the other)
            row["other (s)"] = float("nan") if row["overlap"] else total - sum(row[c] for c in COLUMNS)
            rows.append(row)
    return pd.DataFrame(rows)
