"""lm-evaluation-harness (its Hugging Face backend, batched and length-sorted) against
`flexgen-helm eval` with our defaults, on the same weights and the same data, one right
after the other, as many rounds as asked (read each round as a ratio: this machine's speed
moves by 20% between runs).

    python -m flexgen_helm.tools.compare.lm_eval_harness --lm-eval-python /path/to/venv/bin/python
    python -m flexgen_helm.tools.compare.lm_eval_harness --lm-eval-python PY --task wikitext --out runs/lm_eval/wikitext

lm-eval is not one of our dependencies: install it into its own environment (e.g.
`python -m venv --system-site-packages V && V/bin/pip install lm-eval`, so it shares our
torch) and name that interpreter. Its model is the GGUF's weights exported as a
transformers folder (the one helm_clients compares against); its tasks read local files,
so nothing is downloaded:
- lambada: the local LAMBADA file with lm-eval's own lambada_openai prompt and target;
- wikitext: the WikiText-2 test file's articles (data/wikitext.split_articles, written as
  JSON lines into the comparison's work folder), scored as lm-eval's wikitext task scores
  its documents (rolling log-likelihood, windows of --window tokens) but on the raw text,
  without that task's detokenizer, so both sides score the same characters; ours runs
  `eval --protocol documents` (evaluation/wikitext.py), the same protocol.

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
from dataclasses import dataclass
from pathlib import Path

from flexgen_helm.data.sources import LAMBADA_FILE, WIKITEXT_FILE, local_file, read_wikitext
from flexgen_helm.data.wikitext import split_articles
from flexgen_helm.errors import FlexGenError
from flexgen_helm.memory.folders import unusable_reason
from flexgen_helm.tools.compare.run import loadavg, run_logged
from flexgen_helm.tools.compare.workloads import work_dir

RUNNER = Path(__file__).with_name("lm_eval_runner.py")


@dataclass(frozen=True)
class Task:
    """One task on both sides: ours is `eval --task name`, lm-eval's the local task
    `lm_eval_name`; `metrics`: a column's name -> (lm-eval's key, ours)."""

    name: str
    lm_eval_name: str
    data_file: str
    what: str  # the data, as the README names it
    metrics: dict[str, tuple[str, str]]
    default_limit: int | None  # items scored when --limit is not given (None: all)
    windowed: bool = False  # scored in rolling windows of --window tokens on both sides
    ours_flags: tuple[str, ...] = ()


TASKS = {
    "lambada": Task("lambada", "lambada_local", LAMBADA_FILE, "passages of",
                    {"accuracy": ("acc,none", "accuracy"),
                     "last-word ppl": ("perplexity,none", "last_word_perplexity")}, 500),
    "wikitext": Task("wikitext", "wikitext_local", WIKITEXT_FILE, "articles of",
                     {"bits/byte": ("bits_per_byte,none", "bits_per_byte"),
                      "byte-level ppl": ("byte_perplexity,none", "byte_perplexity")},
                     None, True, ("--protocol", "documents")),
}


def lambada_yaml(lambada: Path) -> str:
    """lm-eval's lambada_openai task (prompt: all but the last word; target: the last word
    after a space) over the local file."""
    return (f"task: {TASKS['lambada'].lm_eval_name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {lambada}\noutput_type: loglikelihood\ntest_split: test\n"
            "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
            "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
            "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
            "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")


def wikitext_yaml(articles: Path) -> str:
    """lm-eval's wikitext task (each document's rolling log-likelihood; word and byte
    perplexity, bits per byte) over the articles file, on their raw text (module doc)."""
    return (f"task: {TASKS['wikitext'].lm_eval_name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {articles}\noutput_type: loglikelihood_rolling\ntest_split: test\n"
            "doc_to_text: \"\"\ndoc_to_target: \"{{page}}\"\n"
            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
            "metadata:\n  version: 1.0\n")


def write_task(task: Task, data: Path, task_dir: Path) -> None:
    """The local task's YAML in `task_dir` (and, for wikitext, its articles file)."""
    if task.name == "lambada":
        text = lambada_yaml(data.resolve())
    else:
        articles = work_dir() / "lm_eval" / "wikitext_articles.jsonl"
        articles.parent.mkdir(parents=True, exist_ok=True)
        lines, _ = read_wikitext(str(data))
        articles.write_text("".join(json.dumps({"page": a}) + "\n" for a in split_articles(lines)))
        text = wikitext_yaml(articles)
    (task_dir / f"{task.lm_eval_name}.yaml").write_text(text)


def _timed(cmd: list[str], timeout_s: int) -> float:
    t0 = time.perf_counter()
    run_logged(cmd, timeout_s)
    return time.perf_counter() - t0


def lm_eval_row(python: str, checkpoint: Path, task_dir: Path, task: Task, limit: int | None, batch: int,
                dtype: str, window: int, json_path: Path, timeout_s: int) -> dict:
    cmd = [python, str(RUNNER), "--checkpoint", str(checkpoint), "--task-dir", str(task_dir),
           "--task", task.lm_eval_name, "--batch-size", str(batch), "--dtype", dtype, "--json", str(json_path)]
    cmd += ["--limit", str(limit)] if limit is not None else []
    cmd += ["--max-length", str(window)] if task.windowed else []
    wall = _timed(cmd, timeout_s)
    rec = json.loads(json_path.read_text())
    return {"system": f"lm-eval hf (batch {batch})", "dtype": dtype, "wall_s": wall, "eval_s": rec["eval_s"],
            "load_s": rec["load_s"], "block": f"batch {batch}", "version": f"lm-eval {rec['lm_eval_version']}",
            "metrics": {col: rec["metrics"][theirs] for col, (theirs, _) in task.metrics.items()},
            "command": shlex.join(cmd)}


def ours_row(task: Task, limit: int | None, dtype: str, window: int, json_path: Path, timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "flexgen_helm", "eval", "--task", task.name, *task.ours_flags]
    cmd += ["--limit", str(limit)] if limit is not None else []
    cmd += ["--window", str(window)] if task.windowed else []
    cmd += ["--dtype", dtype, "--quiet", "--json", str(json_path)]
    wall = _timed(cmd, timeout_s)
    rec = json.loads(json_path.read_text())
    pol = rec["policy"]
    metrics = dict(rec["metrics"])
    if "bits_per_byte" in metrics:  # lm-eval's byte perplexity: 2 ** bits per byte
        metrics["byte_perplexity"] = 2 ** metrics["bits_per_byte"]
    return {"system": "flexgen-helm eval (defaults)", "dtype": dtype, "wall_s": wall, "eval_s": rec["eval_s"],
            "load_s": rec["load_s"], "block": f"{pol['gpu_batch_size']} x {pol['num_gpu_batches']}",
            "version": "ours", "metrics": {col: metrics[key] for col, (_, key) in task.metrics.items()},
            "command": shlex.join(cmd)}


def table(rows: list[dict]) -> str:
    columns = list(rows[0]["metrics"])
    head = ("| round | dtype | system | block | scoring s | process s | scoring ratio | process ratio | "
            + " | ".join(columns) + " | load before |\n|---|---|---|---|---:|---:|---:|---:|"
            + "---:|" * len(columns) + "---:|\n")
    lines = []
    for r in rows:
        values = " | ".join(f"{r['metrics'][c]:.4f}" for c in columns)
        lines.append(f"| {r['round']} | {r['dtype']} | {r['system']} | {r['block']} | {r['eval_s']:.1f} "
                     f"| {r['wall_s']:.1f} | {r.get('scoring_ratio', 1.0):.2f}x | {r.get('process_ratio', 1.0):.2f}x "
                     f"| {values} | {r['loadavg']:.2f} |")
    return head + "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        ours = [r for r in rows if r["dtype"] == dtype and r["version"] == "ours"]
        out.append(f"- {dtype}: ours / lm-eval, median over {len(ours)} round(s): scoring "
                   f"{statistics.median(r['scoring_ratio'] for r in ours):.2f}x, whole process "
                   f"{statistics.median(r['process_ratio'] for r in ours):.2f}x (speed: lm-eval's time / ours)")
    return "\n".join(out) + "\n"


def readme(rows: list[dict], arguments: str, task: Task, limit: int | None, window: int, dtypes: int) -> str:
    lm_eval_version = next(r["version"] for r in rows if r["version"] != "ours")
    data = f"The {'first ' + str(limit) if limit is not None else 'all'} {task.what} {task.data_file}"
    if task.windowed:
        data += (f", scored by rolling log-likelihood in windows of {window} tokens on both sides (lm-eval's "
                 "wikitext protocol, on the raw text: no detokenizer; ours: `eval --protocol documents`)")
    return (f"# flexgen-helm eval vs lm-evaluation-harness (HF backend) on {task.name}\n\n"
            f"Generated by `python -m flexgen_helm.tools.compare.lm_eval_harness {arguments}` "
            "(flexgen_helm/tools/compare/lm_eval_harness.py); every number is in results.json.\n\n"
            f"Host: {rows[0]['host']}. {data}; {lm_eval_version} (from PyPI, in its own environment made with "
            f"--system-site-packages, so on our torch); its task: task/{task.lm_eval_name}.yaml; its model: the "
            "GGUF's weights exported as a transformers folder. Within a round the two ran back to back; ratios are "
            "lm-eval's time over ours (above 1: ours is faster). 'scoring' is lm-eval's simple_evaluate and our "
            "eval's eval_s; 'process' is each command from start to exit, model load included.\n\n"
            + summary(rows) + "\n" + table(rows) + "\nCommands:\n\n"
            + "\n".join(f"    {r['command']}" for r in rows[:2 * dtypes]) + "\n")


def main(argv=None) -> int:
    from flexgen_helm.memory.machine import machine_label
    from flexgen_helm.tools.compare.helm_clients import export_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval-python", required=True, help="the interpreter lm-eval is installed in")
    p.add_argument("--task", choices=list(TASKS), default="lambada")
    p.add_argument("--limit", type=int, help="the first N LAMBADA passages (default 500) or WikiText articles "
                                             "(default: all)")
    p.add_argument("--window", type=int, default=1024, help="WikiText: tokens per rolling window (lm-eval's "
                                                             "max_length)")
    p.add_argument("--batch-size", type=int, default=16, help="lm-eval's batch")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    p.add_argument("--out", default="runs/lm_eval")
    args = p.parse_args(argv)
    task = TASKS[args.task]
    limit = task.default_limit if args.limit is None else args.limit
    data = local_file(task.data_file, None)
    if not data:
        raise FlexGenError(f"no local {task.data_file}: lm-eval's side must read the same file as ours")
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
    write_task(task, Path(data), task_dir)
    checkpoint = export_checkpoint()
    rows = []
    for rnd in range(1, args.rounds + 1):
        for dtype in args.dtypes:
            load = loadavg()
            theirs = lm_eval_row(args.lm_eval_python, checkpoint, task_dir, task, limit, args.batch_size, dtype,
                                 args.window, out / "json" / f"lm_eval_{dtype}_r{rnd}.json", args.timeout)
            theirs.update(round=rnd, loadavg=load)
            load = loadavg()
            ours = ours_row(task, limit, dtype, args.window, out / "json" / f"ours_{dtype}_r{rnd}.json", args.timeout)
            ours.update(round=rnd, loadavg=load, scoring_ratio=theirs["eval_s"] / ours["eval_s"],
                        process_ratio=theirs["wall_s"] / ours["wall_s"])
            rows += [theirs, ours]
            print(table(rows[-2:]), flush=True)
    host = machine_label()
    for r in rows:
        r["host"] = host
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "README.md").write_text(readme(rows, shlex.join(argv or sys.argv[1:]), task, limit, args.window,
                                          len(args.dtypes)))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
