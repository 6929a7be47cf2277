"""Prompts that share nothing: what prefix sharing costs them (issue 47's 2% bound).

    python runs/prefix_sharing/no_share_check/ab.py [--rounds 5] [--lambada 500] [--wikitext-tokens 32768]

One engine (the bundled SmolLM2 in its default dtype, blocks of 32), after a warm-up;
each round runs three workloads with sharing on and off, the order alternating between
rounds: LAMBADA scored (its last words), LAMBADA generated (the target's tokens, greedy),
and WikiText-2 windows scored. Prompts of these share at most a few tokens, so with sharing
on a block only scans its prompts' common prefix and then runs the unchanged path. Per
workload: each run's seconds, the median of the per-round ratios on/off, and whether the
results were equal. Appends one JSON line to results.jsonl beside this file, with the host
and the load average before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from flexgen_helm.data.sources import read_lambada, read_wikitext
from flexgen_helm.engine import Engine
from flexgen_helm.evaluation import lambada, wikitext
from flexgen_helm.evaluation.run import lambada_chunk
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy import Policy
from flexgen_helm.weights.registry import resolve

HERE = Path(__file__).resolve().parent
WINDOW = 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lambada", type=int, default=500, help="LAMBADA passages")
    p.add_argument("--wikitext-tokens", type=int, default=32768)
    args = p.parse_args()
    tokenizer = resolve("smollm2-135m").load_tokenizer()
    items, _ = lambada.prepare(tokenizer, read_lambada()[0][:args.lambada])
    ids, text = wikitext.tokenize(tokenizer, read_wikitext()[0], None)
    ids = ids[:args.wikitext_tokens]
    engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=32), progress=False)
    chunk = lambada_chunk(engine.policy)
    workloads = {
        "lambada scored": lambda: lambada.evaluate(engine, items, chunk, progress=False)["nll"],
        "lambada generated": lambda: lambada.generation_accuracy(engine, items, chunk, progress=False)[1],
        "wikitext scored": lambda: wikitext.evaluate(engine, ids, text, WINDOW, engine.policy.block_size,
                                                     progress=False)["metrics"],
    }
    base = engine.policy
    load_before = os.getloadavg()[0]
    for run in workloads.values():  # warm-up
        run()
    seconds = {name: {"on": [], "off": []} for name in workloads}
    results = {name: {} for name in workloads}
    for r in range(args.rounds):
        for sharing in ((True, False) if r % 2 == 0 else (False, True)):
            engine.set_policy(dataclasses.replace(base, prefix_sharing=sharing))
            key = "on" if sharing else "off"
            for name, run in workloads.items():
                t0 = time.perf_counter()
                results[name][key] = run()
                seconds[name][key].append(time.perf_counter() - t0)
    summary = {name: {"seconds": s,
                      "median_ratio_on_off": statistics.median(a / b for a, b in zip(s["on"], s["off"])),
                      "same_results": results[name]["on"] == results[name]["off"]}
               for name, s in seconds.items()}
    record = {"host": machine_label(), "dtype": engine.precision, "policy": engine.policy.describe(),
              "lambada_passages": len(items), "wikitext_tokens": len(ids), "rounds": args.rounds,
              "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0], "workloads": summary,
              "command": "python runs/prefix_sharing/no_share_check/ab.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    with open(HERE / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    for name, s in summary.items():
        print(f"{name}: on/off median {s['median_ratio_on_off']:.4f}, same results: {s['same_results']}")


if __name__ == "__main__":
    main()
