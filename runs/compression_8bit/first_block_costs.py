"""What a compressed deployment's first block pays that later blocks do not: the dequantization of
every compressed weight into its dense copy (kept across blocks since the weights are all in the
compute tier: ModelRuntime.dense_copies), against the prefill of successive blocks.

    python runs/compression_8bit/first_block_costs.py [--blocks 4] [--out DIR]

SmolLM2-135M in RAM, float32 (this CPU's default without bf16 arithmetic; --dtype to change), the
main job's 8-bit (per channel) and 4-bit (the GGUF's own codes) weights with their dense copies
kept, and the plain model. First, each deployment's compressed weights dequantized one by one
(seconds, elements per second). Then --blocks blocks of 8 prompts of 300 tokens (prefill only),
the engines rotating block by block, each engine's first block its first ever. Appends one JSON
line to first_block_costs.jsonl in --out (default: beside this file), with the host and the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from flexgen_helm.compression.int4 import CompressedWeight
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.hardware_profile import use_profile
from flexgen_helm.policy import Policy
from flexgen_helm.policy.policy import PER_CHANNEL, Compression

HERE = Path(__file__).resolve().parent
WEIGHTS = {"plain": None, "8-bit per channel": Compression(8, PER_CHANNEL),
           "4-bit GGUF codes": Compression(4, 32, method="gguf")}


def dequantization_s(engine: Engine) -> tuple[float, int]:
    """Seconds to make every compressed weight's dense copy, and the elements made."""
    seconds, elements = 0.0, 0
    for layer in engine.runtime.layers:
        for w in engine.runtime.load_layer(layer).values():
            if isinstance(w, CompressedWeight):
                t0 = time.perf_counter()
                elements += w.dense().numel()  # the copy a prefill's first use makes
                seconds += time.perf_counter() - t0
    return seconds, elements


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args()
    use_profile()
    load_before = os.getloadavg()[0]
    engines = {name: Engine.load("smollm2-135m", Policy(8, 1, compress_weight=cw, keep_dense_weights=cw is not None),
                                 dtype=args.dtype, device="cpu", progress=False) for name, cw in WEIGHTS.items()}
    dequant = {}
    for name, engine in engines.items():
        if WEIGHTS[name] is not None:
            seconds, elements = dequantization_s(engine)
            dequant[name] = {"seconds": round(seconds, 3), "elements": elements,
                             "elements_per_s": round(elements / seconds)}
            print(name, dequant[name], flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(300)] for _ in range(8)]
    prefill = {name: [] for name in engines}
    for b in range(args.blocks):
        for name, engine in engines.items():
            run = engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
            prefill[name].append(round(run.stats.prefill_s, 3))
        print(f"block {b + 1}: " + ", ".join(f"{n} {v[-1]}" for n, v in prefill.items()), flush=True)
    record = {"host": machine_label(), "dtype": args.dtype, "prompts": "8 x 300", "dequantization": dequant,
              "prefill_s_by_block": prefill, "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "command": "python runs/compression_8bit/first_block_costs.py "
                         f"--blocks {args.blocks} --dtype {args.dtype}"}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "first_block_costs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
