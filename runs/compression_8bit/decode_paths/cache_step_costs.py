"""What one decode step costs a layer's per-token compressed KV cache on the CPU, held compressed or
held dense (Policy.keep_dense_cache), at SmolLM2's shapes: the rounding of the step's new K and V
(fake_quantize, against the dequantize(quantize()) it replaced), and the unpack a compressed cache
does of every held position (dequantize_into), which the dense cache skips.

    python runs/compression_8bit/decode_paths/cache_step_costs.py [--units 30] [--positions 160] [--out DIR]

units: a GPU batch's sequences x key-value heads (10 x 3, the README main job's block); positions:
the cache's length (128 prompt + 32 new). float32, 8 bits in groups of 64 (the 8-bit deployment's
cache). Each timing is the median of 7 repeats of 200 calls, after a warm-up. Appends one JSON line
to cache_step_costs.jsonl in --out (default: beside this file), with the host and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from flexgen_helm.compression.quantize import CACHE_GROUP_DIM, dequantize, dequantize_into, fake_quantize, quantize
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy.policy import Compression

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import median_per_call

HERE = Path(__file__).resolve().parent
CACHE = Compression(8, 64, cache_grouping="per-token")
HEAD_DIM = 64


def ms_per_call(fn, calls: int = 200, repeats: int = 7) -> float:
    return round(median_per_call(fn, calls, repeats, warmup=20) * 1e3, 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", type=int, default=30)
    p.add_argument("--positions", type=int, default=160)
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    new_kv = torch.randn(2, args.units, HEAD_DIM)  # a step's K and V, rounded in one call
    held = quantize(torch.randn(args.positions, args.units, HEAD_DIM), CACHE, CACHE_GROUP_DIM)
    out = torch.empty(args.units, args.positions, HEAD_DIM).transpose(0, 1)  # as unpack writes it
    rows = {
        "round_new_kv_fake_quantize_ms": ms_per_call(lambda: fake_quantize(new_kv, CACHE, CACHE_GROUP_DIM)),
        "round_new_kv_dequantize_quantize_ms": ms_per_call(
            lambda: dequantize(quantize(new_kv, CACHE, CACHE_GROUP_DIM))),
        "unpack_held_keys_ms": ms_per_call(lambda: dequantize_into(held, out)),
    }
    print(rows, flush=True)
    record = {"host": machine_label(), "threads": torch.get_num_threads(), "units": args.units,
              "positions": args.positions, "cache": CACHE.__dict__, **rows,
              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "command": "python runs/compression_8bit/decode_paths/cache_step_costs.py "
                         f"--units {args.units} --positions {args.positions}"}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "cache_step_costs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
