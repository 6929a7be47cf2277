"""Padding accounting: real vs padded tokens, per request and per run.

Every successful request ran in one engine batch (helm/batching.py). What it reports:
  * in HELM's own RequestResult fields: `batch_size` (requests in the batch) and
    `batch_request_time` (wall time of the engine calls for the batch);
  * what HELM has no field for, in the first completion's `finish_reason["flexgen"]`
    (HELM's `GeneratedOutput.finish_reason` is a free dict, written to
    `scenario_state.json` and to HELM's cache, so cached re-runs keep it), written by
    `to_finish_reason` and read back, with the two HELM fields, by `from_request_result`:

    {
      "precision": "4-bit",       # what the engine computed with (EngineCore.precision: the
                                  # paper's FP16 / BF16 / 8-bit / 4-bit), for the leaderboard
      "host": "box (AMD EPYC, 2 cores, bf16 arithmetic)",  # where it was computed
      "prompt_tokens": 37,        # this request's real prompt tokens (as the engine saw them)
      "generated_tokens": 5,      # this request's real generated tokens, all completions
      "engine": {"id": "9c1d3e5f7a2b", "load_s": 1.8},  # the engine that computed it: loaded
                                  # once per deployment per process (weights read and placed,
                                  # dense copies made), outside every batch's time
      "batch": {                  # the whole batch, summed over its engine calls (the score and
                                  # generate calls of an echo+generate batch): RunStats' numbers
        "id": "1f2e-6650aa1b-12", # requests with the same id ran together
        "mode": "generate",
        "prompt_tokens": 290, "padded_prompt_tokens": 320,
        "computed_prompt_tokens": 120,  # through the layers: each block's shared prefix once
        "generated_tokens": 40, "padded_generated_tokens": 40,
        "prefill_s": 0.4, "decode_s": 1.5
      }
    }

`summarize(records)` adds the batches up once each, giving the paper's padded / actual
token counts, throughputs and efficiency (the report's and `flexgen_padding.json`'s).

A request HELM's cache answered (RequestResult.cached: a rerun in the same folder, or a
scenario another run computed) was computed by an earlier run, perhaps on another host: its
tokens and its batch's engine time are not this run's. `summarize` counts such requests
apart (how many, when and on which hosts they were computed: `request_datetime` and the
record's host) and computes every token count, time and throughput from the requests this
run computed alone, so no figure mixes the two.

The engine's loading is no batch's: `summarize` gives the load time of the engines that
computed the run's requests (each once, however many batches it ran) apart from the engine
time, so a reader sees what a run paid before its first batch without any throughput
counting it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from flexgen_helm.executor.sampling import RunStats
from flexgen_helm.memory.machine import machine_label

# BatchRecord fields that HELM's RequestResult carries itself, by its field name
_IN_HELM_FIELDS = {"size": "batch_size", "time_s": "batch_request_time"}


@dataclass(frozen=True)
class BatchRecord:
    """One engine batch: what it was and what the engine reported for it."""

    id: str  # unique across processes: HELM's cache replays results of earlier runs
    mode: str  # "score", "generate" or "score+generate"
    size: int  # requests in the batch (RequestResult.batch_size)
    time_s: float  # wall time of the batch's engine calls (RequestResult.batch_request_time)
    prompt_tokens: int
    padded_prompt_tokens: int
    generated_tokens: int
    padded_generated_tokens: int
    prefill_s: float
    decode_s: float
    # prompt tokens the layers computed (RunStats): a block's shared prefix once; None in the
    # records of a plugin older than prefix sharing, which computed every padded token
    computed_prompt_tokens: int | None = None

    @property
    def prompt_tokens_computed(self) -> int:
        return self.padded_prompt_tokens if self.computed_prompt_tokens is None else self.computed_prompt_tokens

    @classmethod
    def of_runs(cls, id: str, mode: str, size: int, time_s: float, runs: list[RunStats]) -> "BatchRecord":
        """The record of a batch whose engine calls reported `runs`."""
        return cls(id=id, mode=mode, size=size, time_s=time_s,
                   prompt_tokens=sum(r.prompt_tokens for r in runs),
                   padded_prompt_tokens=sum(r.padded_prompt_tokens for r in runs),
                   computed_prompt_tokens=sum(r.computed_prompt_tokens for r in runs),
                   generated_tokens=sum(r.generated_tokens for r in runs),
                   padded_generated_tokens=sum(r.padded_generated_tokens for r in runs),
                   prefill_s=sum(r.prefill_s for r in runs), decode_s=sum(r.decode_s for r in runs))


@dataclass(frozen=True)
class EngineLoad:
    """The loading of the engine that computed a request (helm/engines.get_engine)."""

    id: str  # unique across processes: one per engine loaded
    load_s: float  # its wall time: the weights read and placed, dense copies made (Engine.load)


@dataclass(frozen=True)
class RequestRecord:
    prompt_tokens: int  # this request's real prompt tokens
    generated_tokens: int  # this request's real generated tokens, all completions
    batch: BatchRecord
    cached: bool = False  # answered from HELM's cache: computed by an earlier run
    computed_at: float | None = None  # when its batch ran (RequestResult.request_datetime, Unix seconds)
    host: str | None = None  # where it was computed (this_host() of that run; None: an older plugin)
    engine: EngineLoad | None = None  # the engine that computed it (None: an older plugin, which had no record)


@lru_cache(maxsize=1)
def this_host() -> str:
    """The machine this process computes on, as a record names it: its name and what it is."""
    return f"{platform.node() or 'unknown host'} ({machine_label()})"


def to_finish_reason(record: RequestRecord, precision: str) -> dict[str, Any]:
    """The JSON for finish_reason["flexgen"]: the record less what HELM's fields carry, and
    the precision and host of the engine that computed it."""
    batch = {k: v for k, v in dataclasses.asdict(record.batch).items() if k not in _IN_HELM_FIELDS}
    entry = {"precision": precision, "host": this_host(), "prompt_tokens": record.prompt_tokens,
             "generated_tokens": record.generated_tokens, "batch": batch}
    if record.engine is not None:
        entry["engine"] = dataclasses.asdict(record.engine)
    return entry


def _flexgen_entry(result: dict[str, Any]) -> dict[str, Any] | None:
    """finish_reason["flexgen"] of a RequestResult as JSON; None where it has none (a failed request)."""
    completions = result.get("completions") or []
    return (completions[0].get("finish_reason") or {}).get("flexgen") if completions else None


def from_request_result(result: dict[str, Any]) -> RequestRecord | None:
    """The record of a RequestResult as JSON (scenario_state.json); None where it has none
    (a failed request)."""
    flexgen = _flexgen_entry(result)
    if flexgen is None:
        return None
    batch = BatchRecord(**flexgen["batch"], **{k: result[helm] for k, helm in _IN_HELM_FIELDS.items()})
    return RequestRecord(prompt_tokens=flexgen["prompt_tokens"], generated_tokens=flexgen["generated_tokens"],
                         batch=batch, cached=bool(result.get("cached")), computed_at=result.get("request_datetime"),
                         host=flexgen.get("host"),
                         engine=EngineLoad(**flexgen["engine"]) if "engine" in flexgen else None)


PRECISION_NOT_RECORDED = "not recorded"


def precision_from_scenario_state(state: dict) -> str:
    """The precision the run's requests were computed at ("BF16", "4-bit", ...); several are
    joined with " + " (HELM's cache held results computed at another dtype: the cache key has
    the dtype only when it is set), none is PRECISION_NOT_RECORDED (no successful request,
    or responses of an older plugin)."""
    entries = (_flexgen_entry(rs.get("result") or {}) for rs in state.get("request_states", []))
    found = {e["precision"] for e in entries if e is not None and "precision" in e}
    return " + ".join(sorted(found)) or PRECISION_NOT_RECORDED


def records_from_scenario_state(state: dict) -> list[RequestRecord]:
    records = (from_request_result(rs.get("result") or {}) for rs in state.get("request_states", []))
    return [r for r in records if r is not None]


def summarize(all_records: list[RequestRecord]) -> dict[str, Any]:
    """Totals over the requests this run computed (real) and over their distinct batches
    (padded, time); those HELM's cache answered counted apart (module doc)."""
    records = [r for r in all_records if not r.cached]
    from_cache = [r for r in all_records if r.cached]
    batches = {r.batch.id: r.batch for r in records}
    real_prompt = sum(r.prompt_tokens for r in records)
    real_gen = sum(r.generated_tokens for r in records)
    padded_prompt = sum(b.padded_prompt_tokens for b in batches.values())
    padded_gen = sum(b.padded_generated_tokens for b in batches.values())
    computed_prompt = sum(b.prompt_tokens_computed for b in batches.values())
    time_s = sum(b.time_s for b in batches.values())
    prefill_s = sum(b.prefill_s for b in batches.values())
    decode_s = sum(b.decode_s for b in batches.values())
    engines = {r.engine.id: r.engine.load_s for r in records if r.engine is not None}
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
        "computed_prompt_tokens": computed_prompt,
        # the share of the padded prompt tokens a shared prefix saved computing
        "prefix_reuse": 1 - computed_prompt / padded_prompt if padded_prompt else None,
        "engine_time_s": time_s,
        # the engine's two stages (RunStats), summed over the batches; the rest of engine_time_s
        # is the calls' setup (tokens checked, blocks planned, results gathered)
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "padded_throughput_tok_s": padded / time_s if time_s else None,
        "actual_throughput_tok_s": actual / time_s if time_s else None,
        "efficiency": actual / padded if padded else None,
        # the loading of the engines that computed these requests, each once, in none of the
        # times above; "engines" names them (id:seconds), so a suite counts each once
        "engine_load_s": sum(engines.values()) if engines else None,
        "engines": " ".join(f"{i}:{t:.3f}" for i, t in sorted(engines.items())) or None,
        "cached_requests": len(from_cache),
        "cached_computed": _provenance(from_cache),
    }


def _provenance(records: list[RequestRecord]) -> str | None:
    """When and where cached requests were computed, in a few words; None for none."""
    if not records:
        return None
    times = sorted(r.computed_at for r in records if r.computed_at is not None)
    when = "at an unrecorded time"
    if times:
        fmt = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")  # noqa: E731
        when = fmt(times[0]) if fmt(times[0]) == fmt(times[-1]) else f"{fmt(times[0])} to {fmt(times[-1])}"
    hosts = sorted({r.host or "an unrecorded host" for r in records})
    return f"computed {when} on {', '.join(hosts)}"


def summarize_run(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "scenario_state.json")) as f:
        return summarize(records_from_scenario_state(json.load(f)))
