"""Find our own JSON results under runs/ and sort them by kind.

Each command writes its own shape (bench: `flexgen-helm bench --json`; the policy
validation's measured runs have the same latency/throughput keys; eval: `flexgen-helm eval
--json`), so a file is classified by the keys it has, not by where it lies: a user may
keep results anywhere under runs/.
"""

from __future__ import annotations

import json
from pathlib import Path

from flexgen_helm.memory.machine import machine_label

NO_HOST = "host not recorded"

BENCH_KEYS = {"policy", "total_latency_s", "total_throughput"}
EVAL_KEYS = {"task", "metrics", "policy"}


def load_json_files(runs_dir: str | Path, skip: Path | None = None) -> list[tuple[Path, dict]]:
    """Every readable JSON object under runs_dir (not under `skip`: the report's own folder)."""
    out = []
    root = Path(runs_dir)
    if not root.is_dir():
        return out
    skip = skip.resolve() if skip else None
    for path in sorted(root.rglob("*.json")):
        if skip and skip in path.resolve().parents:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # half-written or foreign files are not ours to judge
        if isinstance(data, dict):
            out.append((path, data))
    return out


def bench_records(files: list[tuple[Path, dict]]) -> list[dict]:
    return [{**d, "_path": str(p)} for p, d in files if BENCH_KEYS <= d.keys()]


def eval_records(files: list[tuple[Path, dict]]) -> list[dict]:
    return [{**d, "_path": str(p)} for p, d in files if EVAL_KEYS <= d.keys()]


def host_of(record: dict) -> str:
    """The machine a record was measured on, in a few words (results of different hosts are
    never one curve)."""
    info = record.get("hardware") or record.get("machine")
    return machine_label(info) if isinstance(info, dict) and info.get("cpu") else NO_HOST
