"""Links to the results archived under runs/ by earlier runs (other hosts, other days):
named with their host and date, never merged into the tables of the run being reported."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from flexgen_helm.tools.report import records

# folder under runs/ -> what it holds
ARCHIVES = {
    "accuracy": "accuracy FP16 vs 8-bit vs 4-bit on the full LAMBADA and WikiText-2 (paper Table 5)",
    "compare": "ours vs Hugging Face accelerate under the same memory budgets, and the ablations",
    "policy": "the cost model against measured runs; --policy auto against a hand grid",
    "helm_vs_hf": "helm-run through this plugin vs HELM's own HuggingFaceClient",
    "bench/compression": "4-bit weights and KV cache on RAM and disk",
    "engine": "the block schedule with weights in RAM and on disk",
}


def archive_section(root: Path, report_dir: Path) -> list[str]:
    rows = [_row(root / name, what, report_dir) for name, what in ARCHIVES.items()
            if (root / name / "README.md").exists() and (root / name).resolve() != report_dir.resolve()]
    if not rows:
        return []
    return ["## Archived results (other runs; linked, not merged)\n",
            "Measured by other commands, often on other hosts: compare within one archive, not with the "
            "tables above.\n", *rows, ""]


def _row(folder: Path, what: str, report_dir: Path) -> str:
    hosts = sorted({records.host_of(d) for _, d in records.load_json_files(folder)} - {records.NO_HOST})
    host = "; ".join(hosts) if hosts else "host named in its README"
    link = os.path.relpath(folder / "README.md", report_dir)
    return f"- [{folder}/README.md]({link}): {what}. Host: {host}. Last changed: {_date(folder)}."


def _date(folder: Path) -> str:
    """The date of the archive's last commit (file times mean nothing in a fresh clone)."""
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%cs", "--", "."], cwd=folder, capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    return done.stdout.strip() or "unknown (not committed)"
