"""The validation tables: predicted vs measured throughput and peak memory (CSV + README.md).

Predictions come from the saved hardware profile as measured, and again with a
leave-one-out refit (policy/refit.py fitted on every *other* measured run, validation and
grid alike), which says how well the model's shape holds once the machine's steady
slowdown is known, without fitting the row it predicts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.cost_model import CostModel, Workload
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import TIERS, Policy
from flexgen_helm.tools.validation.configs import CONFIGS, MODEL
from flexgen_helm.tools.validation.refit import refit
from flexgen_helm.weights.registry import resolve

GIB = 2**30

NOTES = """## How to read this

- Commands: `flexgen-helm profile --json runs/policy/hardware.json`, then
  `python -m flexgen_helm.tools.validation.validate measure` (each configuration in its own process:
  load, a warm-up at the timed shapes, 2 timed generations, medians), `... validate grid --cpu-mem 2GiB`
  (the auto policy and a hand grid under a RAM budget that forces weights to disk), and
  `... validate report`. The refitted profile: `flexgen-helm profile --json
  runs/policy/hardware_refit.json --refit runs/policy/measured/*.json runs/policy/grid/*.json`.
- "predicted" uses the hardware profile as measured; "LOO-refit" rescales the cost model's
  terms (per phase and resource, least squares on the bottleneck terms) on every other run
  and predicts this one, so a row never fits itself.
- `load` is the 1-minute load average when a row ran (2 cores; one run alone shows ~1.5-2).
  This host's speed also drifts by tens of percent between minutes without load showing it
  (runs/helm_vs_hf/NOTES.md), so the profile and the rows are taken in one sitting.
- CPU-only overlap: the cores that compute also serve the disk reads (system calls, page
  pinning, the copy out of the read buffer), so a read and a linear running at once each go
  slower. The profile measures how much of the shorter of the two fails to hide behind the
  longer (`disk_overlap_loss`, per phase, printed by `flexgen-helm profile`) and the cost model
  charges it to both sides; before, the rows with the KV cache on disk were predicted ~30% too
  fast. The next layer's first cache read is also started while the last GPU batch computes
  (Algorithm 1), where the schedule used to read it only when the layer began.
- Where the model is still short: decode with several GPU batches per block (ram-2x4) is
  predicted faster than measured: per-(layer x GPU batch) Python and copy-engine work that the
  model charges only as op latencies.
- Memory: the gpu/cpu/disk columns are the engine's own accounting (TierUsage: weight homes
  on gpu and cpu, KV cache, activations; disk-tier weights stay in the weight store, the
  whole model, not counted there). "pred host" adds the compute side's working set (the
  loaded weights of a layer and of the next one, a compressed layer's dense copy, the K and V
  read off or going to disk, one GPU batch's activations and attention scores, the logits,
  the freed memory the schedule keeps for reuse: planner/cost_model.py `_peak_bytes`) and the
  profiled baseline RSS of a Python process with torch; on this CPU-only machine the gpu tier
  is host RAM, so it is compared with the process's peak RSS.
"""


def _err(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas if meas else float("nan")


def _predict(profile: HardwareProfile, record: dict):
    cfg = resolve(MODEL, dummy=True).config
    model = CostModel(cfg, profile, Workload(record["prompt_len"], record["gen_len"]))
    return model.estimate(Policy.from_dict(record["policy"]))


def _runs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.name != "grid.json")


def rows_for(folder: Path, profile: HardwareProfile, what: dict[str, str], pool: list[Path]) -> list[dict]:
    """One row per measured run in `folder`; the refit for a row uses every run of `pool` but it."""
    rows = []
    for path in _runs(folder):
        rec = json.loads(path.read_text())
        est = _predict(profile, rec)
        others = [p for p in pool if p != path]
        loo = _predict(refit(profile, others)[0], rec) if others else est
        name = path.stem
        acc = est.accounted_bytes
        host_pred = max(p["gpu"] + p["cpu"] for p in est.peak_bytes.values()) + profile.process_baseline_bytes
        row = {
            "config": name, "what": what.get(name, ""), "prompt_len": rec["prompt_len"], "gen_len": rec["gen_len"],
            "engine_commit": rec.get("engine_commit", ""), "policy": Policy.from_dict(rec["policy"]).describe(),
            "block": rec["block_size"], "loadavg": max(rec.get("loadavg_1min", [0])),
            "measured_tok_s": rec["total_throughput"], "predicted_tok_s": est.throughput,
            "err_pct": _err(est.throughput, rec["total_throughput"]),
            "loo_refit_tok_s": loo.throughput, "loo_err_pct": _err(loo.throughput, rec["total_throughput"]),
            "measured_prefill_s": rec["prefill_latency_s"], "predicted_prefill_s": est.prefill_s,
            "measured_decode_s": rec["decode_latency_s"],
            "predicted_decode_s": est.decode_step_s * (rec["gen_len"] - 1),
            "bottleneck": f"{est.bottleneck['prefill']}/{est.bottleneck['decode']}",
            "rss_scope": rec.get("rss_peak_scope", "whole process (loading included)"),
            "measured_rss_gib": rec["rss_peak_bytes"] / GIB, "predicted_host_gib": host_pred / GIB,
            "rss_err_pct": _err(host_pred, rec["rss_peak_bytes"]),
        }
        for t in TIERS:
            meas = rec["tier_peak_bytes"][t]
            row[f"measured_{t}_gib"] = meas / GIB
            row[f"predicted_{t}_gib"] = acc[t] / GIB
            row[f"{t}_err_pct"] = _err(acc[t], meas) if meas else (0.0 if acc[t] == 0 else float("inf"))
        rows.append(row)
    return rows


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(title for _, title, _ in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(format(r[key], fmt) if fmt else str(r[key]) for key, _, fmt in cols) + " |"
            for r in rows]
    return "\n".join([head, sep, *body])


THROUGHPUT_COLS = [
    ("config", "config", ""), ("block", "block", ""), ("loadavg", "load", ".1f"),
    ("measured_tok_s", "measured tok/s", ".2f"), ("predicted_tok_s", "predicted", ".2f"),
    ("err_pct", "err %", "+.0f"), ("loo_refit_tok_s", "LOO-refit", ".2f"), ("loo_err_pct", "err %", "+.0f"),
    ("measured_prefill_s", "prefill s meas/pred", ".1f"), ("predicted_prefill_s", "", ".1f"),
    ("measured_decode_s", "decode s meas/pred", ".1f"), ("predicted_decode_s", "", ".1f"),
    ("bottleneck", "bottleneck (prefill/decode)", "")]
MEMORY_COLS = [
    ("config", "config", ""),
    *[col for t in TIERS for col in ((f"measured_{t}_gib", f"{t} GiB meas", ".3f"),
                                     (f"predicted_{t}_gib", "pred", ".3f"), (f"{t}_err_pct", "err %", "+.1f"))],
    ("measured_rss_gib", "RSS peak GiB", ".2f"), ("predicted_host_gib", "pred host", ".2f"),
    ("rss_err_pct", "err %", "+.0f"), ("rss_scope", "RSS peak of", "")]
GRID_COLS = [("config", "config", ""), ("policy", "policy", ""), ("measured_tok_s", "measured tok/s", ".2f"),
             ("predicted_tok_s", "predicted", ".2f"), ("loo_refit_tok_s", "LOO-refit", ".2f"),
             ("predicted_rank", "predicted rank", ""), ("measured_rss_gib", "RSS GiB", ".2f")]


def write_report(out: Path, profile_path: str | None = None) -> str:
    """validation.csv, grid.csv and README.md in `out`, from the runs measured there; returns the README."""
    profile = HardwareProfile.load(profile_path or out / "hardware.json")
    what = {k: w for k, (_, w) in CONFIGS.items()}
    pool = _runs(out / "measured") + _runs(out / "grid")
    rows = rows_for(out / "measured", profile, what, pool)
    grid_meta = json.loads((out / "grid" / "grid.json").read_text()) if (out / "grid" / "grid.json").exists() else None
    grid = rows_for(out / "grid", profile, {}, pool) if grid_meta else []
    _write_csv(out / "validation.csv", rows)
    _write_csv(out / "grid.csv", grid)
    lines = _validation_sections(rows, profile)
    if grid:
        lines += _grid_section(grid, grid_meta)
    lines += ["", NOTES]
    text = "\n".join(lines) + "\n"
    (out / "README.md").write_text(text)
    return text


def _validation_sections(rows: list[dict], profile: HardwareProfile) -> list[str]:
    """The README's heading, and its throughput and memory tables with how many rows are within bounds."""
    def within(key, limit):
        ok = [r for r in rows if abs(r[key]) <= limit]
        return f"{len(ok)}/{len(rows)}"

    return [
        f"# Cost model validation: OPT-1.3B (dummy weights), {profile.dtype}, CPU-only",
        "",
        "Produced by `python -m flexgen_helm.tools.validation.validate measure|grid|report` "
        "(flexgen_helm/tools/validation/validate.py).",
        f"Hardware profile: `hardware.json` ({profile.measured_at}; {machine_label(profile.machine)}). "
        f"Workload: prompt {rows[0]['prompt_len']}, "
        f"generation {rows[0]['gen_len']} tokens, engine commit {rows[0]['engine_commit'] or '?'}; each row is the "
        "median of its timed runs; `load` is the machine's 1-minute load average during the run (2 cores, shared).",
        "",
        "## Generation throughput",
        "",
        _table(rows, THROUGHPUT_COLS),
        "",
        f"Within ±25%: {within('err_pct', 25)} with the profile as measured, {within('loo_err_pct', 25)} with the "
        "leave-one-out refit.",
        "",
        "## Peak memory per tier (the engine's TierUsage: weight homes + KV cache + activations)",
        "",
        _table(rows, MEMORY_COLS),
        "",
        f"Within ±10%: gpu {within('gpu_err_pct', 10)}, cpu {within('cpu_err_pct', 10)}, "
        f"disk {within('disk_err_pct', 10)}; process RSS within ±10%: {within('rss_err_pct', 10)}.",
    ]


def _grid_section(grid: list[dict], grid_meta: dict) -> list[str]:
    """The auto policy against the hand grid, by measured throughput, with each row's predicted rank."""
    grid.sort(key=lambda r: -r["measured_tok_s"])
    for rank, r in enumerate(sorted(grid, key=lambda r: -r["predicted_tok_s"]), 1):
        r["predicted_rank"] = rank
    lines = [
        "",
        f"## Auto policy vs a hand grid (--cpu-mem {grid_meta['cpu_mem']}, blocks of at most "
        f"{grid_meta['max_block']} sequences)",
        "",
        _table(grid, GRID_COLS),
    ]
    if grid_meta.get("notes"):
        lines += ["", grid_meta["notes"]]
    return lines
