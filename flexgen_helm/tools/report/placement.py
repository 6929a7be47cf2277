"""Where each bench run kept its bytes: weights per tier as placed (compressed bytes when
the policy compresses them, so a 4-bit run shows its smaller footprint), the peak of what the
engine's TierUsage held on each tier (weight homes, KV cache, activations) and the process's
RSS peak, which also holds the working copies of the layers in use.

From the `memory` field of `flexgen-helm bench --json` records; records without it (older
ones, policy-validation runs) are left out.
"""

from __future__ import annotations

import pandas as pd

from flexgen_helm.evaluation.run import approximations
from flexgen_helm.policy.policy import TIERS
from flexgen_helm.tools.report.frontier import batch_of, setting_of
from flexgen_helm.tools.report.records import host_of

GIB = 2**30


def placement_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        memory = r.get("memory")
        if not memory:
            continue
        weights = memory.get("placement", {}).get("weight_bytes", {})
        row = {"host": host_of(r), "model": r.get("model"), "setting": setting_of(r), "batch": batch_of(r),
               "compression": approximations(r["policy"])}
        row.update({f"weights {t} (GiB)": weights.get(t, 0) / GIB for t in TIERS})
        row.update({f"peak {t} (GiB)": memory["tiers"][t]["peak_bytes"] / GIB for t in TIERS if t in memory["tiers"]})
        rss = memory.get("cpu_peak_rss_bytes")
        row["RSS peak (GiB)"] = rss / GIB if rss else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)
