"""Where a compressed deployment's decode time goes, each weight path and KV-cache grid against
the plain model, in one process with the rounds interleaved (run.sh runs one bench after the
other, and on a shared 2-core host one run's speed moves by 10-40% against the next's).

    python runs/compression_8bit/decode_paths/interleaved.py [--rounds 5] [--sequences 10] [--shared-prefix 0]
        [--paths ...] [--out DIR]

SmolLM2-135M in RAM in this CPU's default dtype (bfloat16 with bf16 arithmetic, else float32),
one GPU batch of --sequences rows, prompts of 128 tokens, 32 new tokens (the README main job's
block); --shared-prefix P: the prompts' first P tokens the same (a few-shot scenario's, computed
once for the block). Every engine is loaded and warmed up first; then each round runs every engine once, the
order rotating from round to round. Per engine: the mean decode step of each round, the
median of the per-round ratios of the plain model's step to its own, and whether its tokens
equal the plain model's. Appends one JSON line to results.jsonl in --out (default: beside this
file), with the host and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.devices import DTYPE_NAMES, pick_devices
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.hardware_profile import use_profile
from flexgen_helm.policy import Policy
from flexgen_helm.policy.policy import PER_CHANNEL, Compression

HERE = Path(__file__).resolve().parent
PROMPT, NEW = 128, 32
W8 = Compression(8, PER_CHANNEL)
W4 = Compression(4, 32, method="gguf")
PATHS = {  # name -> Policy fields besides the block
    "plain": {},
    "w8-kept": {"compress_weight": W8, "keep_dense_weights": True},
    "w4-kept": {"compress_weight": W4, "keep_dense_weights": True},
    # not kept: on the int8 / int4 kernel where one computes in this dtype (bf16), else (float32)
    # dequantized at every use
    "w8-not-kept": {"compress_weight": W8, "keep_dense_weights": False},
    "w4-not-kept": {"compress_weight": W4, "keep_dense_weights": False},
    "kv8-per-token": {"compress_cache": Compression(8, 64, cache_grouping="per-token")},
    # the same values held dense, read in place (Policy.keep_dense_cache)
    "kv8-per-token-dense": {"compress_cache": Compression(8, 64, cache_grouping="per-token"),
                            "keep_dense_cache": True},
    "kv4-kivi": {"compress_cache": Compression(4, 64, cache_grouping="kivi")},
    # its groups mirrored dense beside them, each step adding those it completed (Policy.keep_dense_cache)
    "kv4-kivi-dense": {"compress_cache": Compression(4, 64, cache_grouping="kivi"), "keep_dense_cache": True},
    # the main job's compressed deployments (helm/model_deployments.yaml) as its planner runs them
    "8-bit-deployment": {"compress_weight": W8, "keep_dense_weights": True, "keep_dense_cache": True,
                         "compress_cache": Compression(8, 64, cache_grouping="per-token")},
    "4-bit-deployment": {"compress_weight": W4, "keep_dense_weights": True, "keep_dense_cache": True,
                         "compress_cache": Compression(4, 64, cache_grouping="kivi")},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sequences", type=int, default=10)
    p.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args()
    if "plain" not in args.paths:
        raise SystemExit("--paths must include plain: every ratio is against it")
    use_profile()  # the crossovers this machine's profile measured, as every command applies them
    dtype = DTYPE_NAMES[pick_devices("cpu", None).dtype]
    load_before = os.getloadavg()[0]
    rng = random.Random(0)
    if not 0 <= args.shared_prefix < PROMPT:
        raise SystemExit(f"--shared-prefix: 0 to {PROMPT - 1} of the {PROMPT} prompt tokens")
    shared = [rng.randrange(1000, 40000) for _ in range(args.shared_prefix)]
    prompts = [shared + [rng.randrange(1000, 40000) for _ in range(PROMPT - args.shared_prefix)]
               for _ in range(args.sequences)]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engines = {}
    for name in args.paths:
        policy = Policy(gpu_batch_size=args.sequences, num_gpu_batches=1, **PATHS[name])
        engines[name] = Engine.load("smollm2-135m", policy, dtype=dtype, device="cpu", progress=False)
        engines[name].generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    step_ms = {name: [] for name in engines}
    tokens = {}
    for r in range(args.rounds):
        names = list(engines)
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = engines[name].generate(prompts, params)
            step_ms[name].append(round(run.stats.decode_s / (NEW - 1) * 1e3, 1))
            tokens[name] = [res.completions[0].token_ids for res in run.results]
        print(f"round {r + 1}: " + ", ".join(f"{n} {step_ms[n][-1]}" for n in engines), flush=True)
    rows = {}
    for name in engines:
        ratios = [a / b for a, b in zip(step_ms["plain"], step_ms[name])]
        rows[name] = {"decode_step_ms": step_ms[name], "median_step_ms": statistics.median(step_ms[name]),
                      "speed_vs_plain": round(statistics.median(ratios), 3),
                      "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                      "same_tokens_as_plain": tokens[name] == tokens["plain"]}
        print(name, rows[name], flush=True)
    record = {"host": machine_label(), "dtype": dtype, "sequences": args.sequences, "prompt": PROMPT, "new": NEW,
              "shared_prefix": args.shared_prefix,
              "rounds": args.rounds, "paths": rows,
              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "command": f"python runs/compression_8bit/decode_paths/interleaved.py --rounds {args.rounds} "
                         f"--sequences {args.sequences} --shared-prefix {args.shared_prefix} "
                         f"--paths {' '.join(args.paths)}"}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
