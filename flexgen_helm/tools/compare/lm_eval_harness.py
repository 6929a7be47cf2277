"""lm-evaluation-harness (its Hugging Face backend, batched and length-sorted) against
`flexgen-helm eval` with our defaults, on the same weights and the same LAMBADA passages,
one right after the other, as many rounds as asked (read each round as a ratio: this
machine's speed moves by 20% between runs).

    python -m flexgen_helm.tools.compare.lm_eval_harness --lm-eval-python /path/to/venv/bin/python

lm-eval is not one of our dependencies: install it into its own environment (e.g.
`python -m venv --system-site-packages V && V/bin/pip install lm-eval`, so it shares our
torch) and name that interpreter. Its model is the GGUF's weights exported as a
transformers folder (the one helm_clients compares against); its task reads the local
LAMBADA file with lm-eval's own lambada_openai prompt and target, so nothing is downloaded.

Each side's time is recorded twice: the whole process (start to exit, model load included)
and its scoring alone (lm-eval: `simple_evaluate`; ours: the eval's `eval_s`)."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flexgen_helm.data.sources import LAMBADA_FILE, local_file
from flexgen_helm.errors import FlexGenError
from flexgen_helm.memory.folders import unusable_reason
from flexgen_helm.tools.compare.run import loadavg, run_logged

RUNNER = Path(__file__).with_name("lm_eval_runner.py")
TASK = "lambada_local"


def task_yaml(lambada: Path) -> str:
    """lm-eval's lambada_openai task (prompt: all but the last word; target: the last word
    after a space) over the local file."""
    return (f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {lambada}\n"
            "output_type: loglikelihood\ntest_split: test\n"
            "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
            "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
            "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
            "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")


def _timed(cmd: list[str], timeout_s: int) -> float:
    t0 = time.perf_counter()
    run_logged(cmd, timeout_s)
    return time.perf_counter() - t0


def lm_eval_row(python: str, checkpoint: Path, task_dir: Path, limit: int, batch: int, dtype: str,
                json_path: Path, timeout_s: int) -> dict:
    cmd = [python, str(RUNNER), "--checkpoint", str(checkpoint), "--task-dir", str(task_dir), "--task", TASK,
           "--limit", str(limit), "--batch-size", str(batch), "--dtype", dtype, "--json", str(json_path)]
    wall = _timed(cmd, timeout_s)
    rec = json.loads(json_path.read_text())
    return {"system": f"lm-eval hf (batch {batch})", "dtype": dtype, "wall_s": wall, "eval_s": rec["eval_s"],
            "load_s": rec["load_s"], "accuracy": rec["metrics"]["acc,none"],
            "last_word_perplexity": rec["metrics"]["perplexity,none"], "block": f"batch {batch}",
            "version": f"lm-eval {rec['lm_eval_version']}", "command": shlex.join(cmd)}


def ours_row(limit: int, dtype: str, json_path: Path, timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "flexgen_helm", "eval", "--task", "lambada", "--limit", str(limit),
           "--dtype", dtype, "--quiet", "--json", str(json_path)]
    wall = _timed(cmd, timeout_s)
    rec = json.loads(json_path.read_text())
    pol = rec["policy"]
    return {"system": "flexgen-helm eval (defaults)", "dtype": dtype, "wall_s": wall, "eval_s": rec["eval_s"],
            "load_s": rec["load_s"], "accuracy": rec["metrics"]["accuracy"],
            "last_word_perplexity": rec["metrics"]["last_word_perplexity"],
            "block": f"{pol['gpu_batch_size']} x {pol['num_gpu_batches']}", "version": "ours",
            "command": shlex.join(cmd)}


def table(rows: list[dict]) -> str:
    head = ("| round | dtype | system | block | scoring s | process s | scoring ratio | process ratio | accuracy "
            "| last-word ppl | load before |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        lines.append(f"| {r['round']} | {r['dtype']} | {r['system']} | {r['block']} | {r['eval_s']:.1f} "
                     f"| {r['wall_s']:.1f} | {r.get('scoring_ratio', 1.0):.2f}x | {r.get('process_ratio', 1.0):.2f}x "
                     f"| {r['accuracy']:.4f} | {r['last_word_perplexity']:.3f} | {r['loadavg']:.2f} |")
    return head + "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        ours = [r for r in rows if r["dtype"] == dtype and r["version"] == "ours"]
        out.append(f"- {dtype}: ours / lm-eval, median over {len(ours)} round(s): scoring "
                   f"{statistics.median(r['scoring_ratio'] for r in ours):.2f}x, whole process "
                   f"{statistics.median(r['process_ratio'] for r in ours):.2f}x (speed: lm-eval's time / ours)")
    return "\n".join(out) + "\n"


def readme(rows: list[dict], arguments: str, limit: int, dtypes: int) -> str:
    lm_eval_version = next(r["version"] for r in rows if r["version"] != "ours")
    return ("# flexgen-helm eval vs lm-evaluation-harness (HF backend) on LAMBADA\n\n"
            f"Generated by `python -m flexgen_helm.tools.compare.lm_eval_harness {arguments}` "
            "(flexgen_helm/tools/compare/lm_eval_harness.py); every number is in results.json.\n\n"
            f"Host: {rows[0]['host']}. The first {limit} passages of {LAMBADA_FILE}; {lm_eval_version} (from PyPI, "
            f"in its own environment made with --system-site-packages, so on our torch); its task: task/{TASK}.yaml "
            "(its lambada_openai prompt and target over that file); its model: the GGUF's weights exported as a "
            "transformers folder. Within a round the two ran back to back; ratios are lm-eval's time over ours "
            "(above 1: ours is faster). 'scoring' is lm-eval's simple_evaluate and our eval's eval_s; 'process' is "
            "each command from start to exit, model load included.\n\n"
            + summary(rows) + "\n" + table(rows) + "\nCommands:\n\n"
            + "\n".join(f"    {r['command']}" for r in rows[:2 * dtypes]) + "\n")


def main(argv=None) -> int:
    from flexgen_helm.memory.machine import machine_label
    from flexgen_helm.tools.compare.helm_clients import export_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval-python", required=True, help="the interpreter lm-eval is installed in")
    p.add_argument("--limit", type=int, default=500, help="the first N LAMBADA passages")
    p.add_argument("--batch-size", type=int, default=16, help="lm-eval's batch")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    p.add_argument("--out", default="runs/lm_eval")
    args = p.parse_args(argv)
    lambada = local_file(LAMBADA_FILE, None)
    if not lambada:
        raise FlexGenError(f"no local {LAMBADA_FILE}: lm-eval's side must read the same file as ours")
    try:
        probe = subprocess.run([args.lm_eval_python, "-c", "import lm_eval"], capture_output=True, text=True)
    except OSError as e:
        raise FlexGenError(f"cannot run {args.lm_eval_python}: {e}") from e
    if probe.returncode != 0:
        raise FlexGenError(f"{args.lm_eval_python} cannot import lm_eval: {probe.stderr.strip()[-500:]}")
    out = Path(args.out)
    reason = unusable_reason(out / "json")
    if reason is not None:
        raise FlexGenError(f"cannot create the output folder {out / 'json'}, or write in it: {reason}")
    task_dir = out / "task"
    task_dir.mkdir(exist_ok=True)
    (task_dir / f"{TASK}.yaml").write_text(task_yaml(Path(lambada).resolve()))
    checkpoint = export_checkpoint()
    rows = []
    for rnd in range(1, args.rounds + 1):
        for dtype in args.dtypes:
            load = loadavg()
            theirs = lm_eval_row(args.lm_eval_python, checkpoint, task_dir, args.limit, args.batch_size, dtype,
                                 out / "json" / f"lm_eval_{dtype}_r{rnd}.json", args.timeout)
            theirs.update(round=rnd, loadavg=load)
            load = loadavg()
            ours = ours_row(args.limit, dtype, out / "json" / f"ours_{dtype}_r{rnd}.json", args.timeout)
            ours.update(round=rnd, loadavg=load, scoring_ratio=theirs["eval_s"] / ours["eval_s"],
                        process_ratio=theirs["wall_s"] / ours["wall_s"])
            rows += [theirs, ours]
            print(table(rows[-2:]), flush=True)
    host = machine_label()
    for r in rows:
        r["host"] = host
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "README.md").write_text(readme(rows, shlex.join(argv or sys.argv[1:]), args.limit, len(args.dtypes)))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
