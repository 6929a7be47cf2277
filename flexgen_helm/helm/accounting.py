"""Padding accounting: real vs padded tokens, per request and per run.

Where it lives: every successful request's first completion carries
`finish_reason["flexgen"]` (HELM's `GeneratedOutput.finish_reason` is a free dict and is
written to `scenario_state.json` and to HELM's cache, so cached re-runs keep it):

    {
      "prompt_tokens": 37,              # this request's real prompt tokens (as the engine saw them)
      "generated_tokens": 5,            # this request's real generated tokens, all completions
      "batch_id": "1f2e-6650aa1b-12",  # requests with the same batch_id ran together
      "batch_size": 8, "batch_mode": "generate",
      "batch_time_s": 1.9,              # wall time of the engine calls for the batch
      "batch_prompt_tokens": 290, "batch_padded_prompt_tokens": 320,
      "batch_generated_tokens": 40, "batch_padded_generated_tokens": 40,
      "batch_prefill_s": 0.4, "batch_decode_s": 1.5, "batch_total_s": 1.9
    }

`batch_*` numbers are the engine's `last_stats` for the whole batch (summed over the
score and generate calls of an echo+generate batch). `summarize_run(run_dir)` adds them
up once per batch, giving the paper's padded / actual token counts and efficiency.
"""

from __future__ import annotations

import json
import os
from typing import Any


def request_record(prompt_tokens: int, generated_tokens: int, batch: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "generated_tokens": generated_tokens, **batch}


def records_from_scenario_state(state: dict) -> list[dict]:
    out = []
    for rs in state.get("request_states", []):
        comps = (rs.get("result") or {}).get("completions") or []
        rec = ((comps[0].get("finish_reason") or {}).get("flexgen")) if comps else None
        if rec:
            out.append(rec)
    return out


def summarize(records: list[dict]) -> dict[str, Any]:
    """Totals over requests (real) and over distinct batches (padded, time)."""
    batches = {r["batch_id"]: r for r in records if "batch_id" in r}
    real_prompt = sum(r.get("prompt_tokens", 0) for r in records)
    real_gen = sum(r.get("generated_tokens", 0) for r in records)
    padded_prompt = sum(b.get("batch_padded_prompt_tokens", 0) for b in batches.values())
    padded_gen = sum(b.get("batch_padded_generated_tokens", 0) for b in batches.values())
    time_s = sum(b.get("batch_time_s", 0.0) for b in batches.values())
    padded = padded_prompt + padded_gen
    actual = real_prompt + real_gen
    return {
        "requests": len(records),
        "batches": len(batches),
        "mean_batch_size": (len(records) / len(batches)) if batches else 0.0,
        "prompt_tokens": real_prompt,
        "generated_tokens": real_gen,
        "padded_prompt_tokens": padded_prompt,
        "padded_generated_tokens": padded_gen,
        "engine_time_s": time_s,
        "padded_throughput_tok_s": padded / time_s if time_s else None,
        "actual_throughput_tok_s": actual / time_s if time_s else None,
        "efficiency": actual / padded if padded else None,
    }


def summarize_run(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "scenario_state.json")) as f:
        return summarize(records_from_scenario_state(json.load(f)))
