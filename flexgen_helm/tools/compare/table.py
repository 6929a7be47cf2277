"""Rows of a comparison (the JSON each system's process wrote) into the paper-style table:
throughput with the policy in each cell, the ratio to accelerate, the cost model's
prediction, the roofline (roofline.py) and the percent of it reached, where the weights were
read from, and the process's RSS peak against the budgets. Written as CSV and as the README
of its folder."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from flexgen_helm.memory.machine import machine_label

GIB = 2**30
RSS_SLACK = 0.5 * GIB  # the bound: process RSS peak <= gpu + cpu budgets + this
COLUMNS = ["setup", "system", "label", "policy", "effective_batch", "prefill_s", "decode_s", "total_s",
           "throughput_tok_s", "vs_accelerate", "predicted_tok_s", "predicted_over_measured", "roofline_tok_s",
           "pct_of_roofline", "roofline_bound", "disk_device_gb_s", "disk_weight_gib", "disk_read_gib",
           "disk_reads_per_token", "weights_read_from", "peak_rss_gib", "rss_limit_gib", "rss_within_limit",
           "compute_time_scale", "loadavg_1m", "host"]


def disk_weight_bytes(record: dict) -> int:
    if "disk_weight_bytes" in record:  # accelerate's rows say it themselves
        return record["disk_weight_bytes"]
    return record.get("memory", {}).get("placement", {}).get("weight_bytes", {}).get("disk", 0)


def ram_weight_bytes(record: dict) -> int:
    """The weights our run placed in RAM on a CPU machine: its gpu and cpu tiers' (accelerate's
    records do not say: 0)."""
    placed = record.get("memory", {}).get("placement", {}).get("weight_bytes", {})
    return placed.get("gpu", 0) + placed.get("cpu", 0)


def disk_cache_bytes(record: dict) -> int:
    """The KV cache and activations our run placed on the disk tier (accelerate keeps them on
    the device: 0)."""
    return record.get("memory", {}).get("tiers", {}).get("disk", {}).get("peak_bytes", 0)


def _peak_rss_bytes(record: dict) -> int:
    """The process's peak RSS: under "memory" in our records, at the top level in accelerate's."""
    return record.get("memory", {}).get("cpu_peak_rss_bytes") or record.get("cpu_peak_rss_bytes", 0)


def row(setup: str, system: str, record: dict, context: dict) -> dict:
    """One table row. `context`: "roofline" (roofline.Roofline or None), "predicted_tok_s" (the
    cost model's, ours only), "rss_limit_bytes" (gpu + cpu budgets + RSS_SLACK),
    "device_bytes_per_s" (the disk's bandwidth), "compute_time_scale" (run.with_compute_speed_now),
    "loadavg"."""
    if record.get("skipped"):
        return {"setup": setup, "system": system, "label": record.get("label", system),
                "policy": record.get("policy_summary", ""), "weights_read_from": record["skipped"]}
    b = record["effective_batch_size"]
    disk = disk_weight_bytes(record)
    read = record.get("disk_read_bytes")
    passes = record["gen_len"]  # one read of the disk weights per generated token (prefill included)
    if record.get("system", "").startswith("hf-accelerate"):
        evict = record["page_cache"]["evict_each_token"]
        source = "disk via mmap, page cache evicted " + ("before every token" if evict else "before the run only")
    else:
        source = f"disk, {record['memory']['disk_page_cache_bypass']} (no page cache)" if disk else "RAM only"
    measured = record["total_throughput"]
    roof, predicted = context.get("roofline"), context.get("predicted_tok_s")
    rss, limit = _peak_rss_bytes(record), context.get("rss_limit_bytes")
    device = context.get("device_bytes_per_s")
    return {
        "setup": setup, "system": system, "label": record.get("label") or system,
        "policy": record.get("policy_summary", ""), "effective_batch": b,
        "prefill_s": round(record["prefill_latency_s"], 2), "decode_s": round(record["decode_latency_s"], 2),
        "total_s": round(record["total_latency_s"], 2), "throughput_tok_s": round(measured, 4),
        "predicted_tok_s": None if predicted is None else round(predicted, 4),
        "predicted_over_measured": None if predicted is None else round(predicted / measured, 2),
        "roofline_tok_s": None if roof is None else round(roof.tokens_per_s, 4),
        "pct_of_roofline": None if roof is None else round(100 * measured / roof.tokens_per_s, 1),
        "roofline_bound": None if roof is None else f"prefill {roof.prefill_bound}, decode {roof.decode_bound}",
        "disk_device_gb_s": None if device is None else round(device / 1e9, 3),
        "disk_weight_gib": round(disk / GIB, 2),
        "disk_read_gib": None if read is None else round(read / GIB, 2),
        "disk_reads_per_token": round(read / (disk * passes), 2) if read is not None and disk else None,
        "weights_read_from": source,
        "peak_rss_gib": round(rss / GIB, 2),
        "rss_limit_gib": None if limit is None else round(limit / GIB, 2),
        "rss_within_limit": None if limit is None else rss <= limit,
        "compute_time_scale": None if context.get("compute_time_scale") is None
        else round(context["compute_time_scale"], 2),
        "loadavg_1m": context.get("loadavg"),
        "host": machine_label(record["hardware"]) if record.get("hardware") else None,
    }


def add_ratios(rows: list[dict]) -> None:
    """Throughput over accelerate's in the same setup (the paper's headline ratio)."""
    base = {r["setup"]: r["throughput_tok_s"] for r in rows
            if r["system"] == "hf-accelerate" and r.get("throughput_tok_s")}
    for r in rows:
        if r.get("throughput_tok_s") and r["setup"] in base:
            r["vs_accelerate"] = round(r["throughput_tok_s"] / base[r["setup"]], 2)


def to_csv(rows: list[dict], columns: list[str] | None = None) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, columns or COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()


def from_csv(text: str) -> list[dict]:
    return [{k: (v if v != "" else None) for k, v in r.items()} for r in csv.DictReader(io.StringIO(text))]


def to_markdown(rows: list[dict], columns: list[str] | None = None) -> str:
    cols = columns or COLUMNS
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def write(folder: Path, rows: list[dict], title: str, notes: list[str], commands: list[str],
          columns: list[str] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.csv").write_text(to_csv(rows, columns))
    md = [f"# {title}", "", *notes, "", to_markdown(rows, columns), "", "## Commands (exactly what ran, in order)", "",
          "```bash", *commands, "```", ""]
    (folder / "README.md").write_text("\n".join(md))
