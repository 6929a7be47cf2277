"""A decode step with products multiplied as F.linear (x W^T) against W x^T on the band of
row counts where this machine's profile measured it faster (flexgen_helm/dense_linear.py).

    python runs/bench/linear_orientation/decode_ab.py [--sequences 16 48] [--rounds 4] [--dtype float32]

One engine (the bundled SmolLM2, one GPU batch of --sequences), prompts of 240 tokens whose
first 197 are shared (synthetic_reasoning's shape), 20 new tokens. After a warm-up, each
round runs the block both ways, the order alternating between rounds. Per block size: the
mean decode step of each run, the median of the per-round ratios, and whether the tokens
were equal. Appends one JSON line to results.jsonl beside this file, with the host, the
profile's band of row counts and gains, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import torch

from flexgen_helm.dense_linear import NO_ROWS, set_flipped_rows
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.hardware_profile import saved_profile
from flexgen_helm.policy import Policy

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, nargs="+", default=[16, 48])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    args = p.parse_args()
    profile, missing = saved_profile()
    if profile is None:
        raise SystemExit(f"{missing}: run `flexgen-helm profile` first (this compares against its band of row counts)")
    band = profile.compute.flipped_rows(args.dtype)
    if band == NO_ROWS:
        raise SystemExit(f"this machine's profile measured no gain from W x^T in {args.dtype} "
                         f"({profile.compute.flipped_gains.get(args.dtype)}): nothing to compare")
    load_before = os.getloadavg()[0]
    rng = random.Random(0)
    shared = [rng.randrange(1000, 40000) for _ in range(197)]
    record = {"host": machine_label(), "dtype": args.dtype, "flipped_rows": band,
              "gains": profile.compute.flipped_gains.get(args.dtype), "new_tokens": NEW_TOKENS, "blocks": {}}
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for n in args.sequences:
        engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=n, num_gpu_batches=1), dtype=args.dtype,
                             progress=False)
        prompts = [shared + [rng.randrange(1000, 40000) for _ in range(43)] for _ in range(n)]
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=3, ignore_eos=True))  # warm-up
        step_ms = {"F.linear": [], "W x^T": []}
        tokens = {}
        for r in range(args.rounds):
            ways = [("F.linear", NO_ROWS), ("W x^T", band)]
            for name, rows in ways if r % 2 == 0 else ways[::-1]:
                set_flipped_rows("cpu", DTYPES[args.dtype], rows)
                run = engine.generate(prompts, params)
                step_ms[name].append(round(run.stats.decode_s / (NEW_TOKENS - 1) * 1e3, 1))
                tokens[name] = [res.completions[0].token_ids for res in run.results]
        ratios = [a / b for a, b in zip(step_ms["F.linear"], step_ms["W x^T"])]
        record["blocks"][n] = {"decode_step_ms": step_ms, "median_ratio": round(statistics.median(ratios), 3),
                               "same_tokens": tokens["F.linear"] == tokens["W x^T"]}
        print(n, record["blocks"][n], flush=True)
    record["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    record["command"] = "python runs/bench/linear_orientation/decode_ab.py " + " ".join(
        f"--sequences {' '.join(map(str, args.sequences))} --rounds {args.rounds} --dtype {args.dtype}".split())
    with open(HERE / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
