"""A CPU decode step's attention (executor/attention.attend, one query per unit) over a bf16
cache in the KV cache's position-major layout, whole against a piece of positions at a time
(_decode_by_positions), for the caches of a batch of 32 sequences: OLMoE (16 units a sequence,
1 query head each, d 128), SmolLM2 (3 units of 3, d 64), OPT-1.3B (32 of 1, d 64). Eight
layers' caches are attended in turn, as a decode step does, so that no cache is still in the
CPU's caches when it is read again; the time is per layer, the best of `--repeats` passes,
each system in turn for `--rounds` rounds (this host's last-level cache is shared with other
machines, and its speed can change between rounds: see the README beside this file).

    python runs/bench/decode_by_positions/bench.py --out runs/bench/decode_by_positions/results.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from flexgen_helm.executor.attention import attend
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.models import cache_pieces

# (model, units, query heads a unit, head dim, keys)
SHAPES = (("olmoe", 512, 1, 128, 129), ("olmoe", 512, 1, 128, 200), ("olmoe", 512, 1, 128, 256),
          ("smollm2", 96, 3, 64, 544), ("smollm2", 96, 3, 64, 1016), ("opt-1.3b", 1024, 1, 64, 544))
LAYERS = 8


def step_of(q: torch.Tensor, caches: list, valid: torch.Tensor, layer: int) -> torch.Tensor:
    return attend(q, *caches[layer], valid, causal=False)


def per_layer_ms(step, repeats: int) -> float:
    step(0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            step(layer)
        best = min(best, (time.perf_counter() - t0) / LAYERS)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    keep_freed_host_memory()  # as the engine runs
    host = f"{machine_label()}, torch {torch.__version__}"
    torch.manual_seed(0)
    pieced_from = cache_pieces.PIECED_FROM
    with open(args.out, "a") as f:
        for model, units, r, d, keys in SHAPES:
            q = torch.randn(units, r, 1, d).bfloat16()
            # the slots' layout: (rows, units, d), read as a (units, keys, d) view
            caches = [[torch.randn(keys + 8, units, d).bfloat16()[:keys].transpose(0, 1) for _ in range(2)]
                      for _ in range(LAYERS)]
            valid = torch.rand(units, keys) > 0.1
            valid[:, -1] = True

            step = functools.partial(step_of, q, caches, valid)
            times = {"whole": [], "by_positions": []}
            for _ in range(args.rounds):
                for system in times:
                    cache_pieces.PIECED_FROM = 1 << 62 if system == "whole" else pieced_from
                    times[system].append(round(per_layer_ms(step, args.repeats), 3))
            cache_pieces.PIECED_FROM = 1 << 62
            whole = step(0).float()
            cache_pieces.PIECED_FROM = pieced_from
            by_positions = step(0).float()
            row = {"model": model, "units": units, "query_heads": r, "head_dim": d, "keys": keys,
                   "whole_ms": times["whole"], "by_positions_ms": times["by_positions"],
                   "speedup_per_round": [round(a / b, 2) for a, b in zip(times["whole"], times["by_positions"])],
                   "max_abs_difference": (whole - by_positions).abs().max().item(),
                   "max_abs_output": whole.abs().max().item(),
                   "load_1m": os.getloadavg()[0], "host": host,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            print(row, flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
