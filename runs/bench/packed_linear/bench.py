"""F.linear against a weight packed once in oneDNN's blocked layout (dense_linear.PackedLinear),
per row count and weight shape, and whether the outputs are bit for bit the same.

    python runs/bench/packed_linear/bench.py [--dtypes bfloat16 float32] [--repeats 10]
        [--shapes 49152x576] [--rows 1 8 32 128]

(49152x576: SmolLM2's tied embedding as its head multiplies it, a decode step's largest product.)

Each shape's weights are distinct matrices adding up to ~64 MB (no cache reuse between calls,
as a decode step's weights stream from memory). Appends one JSON line to results.jsonl beside
this file, with the host and the load average; prints speed-ups (F.linear time / packed time).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.memory.machine import machine_label

HERE = Path(__file__).resolve().parent
SHAPES = [(1024, 2048), (2048, 2048), (1536, 576), (576, 1536)]  # OLMoE's expert, its attention; SmolLM2's MLP
ROWS = [1, 4, 16, 64, 512, 2048]


def seconds(f, x, weights, repeats: int) -> float:
    for w in weights[:2]:
        f(x, w)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            f(x, w)
    return (time.perf_counter() - t0) / (repeats * len(weights))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--shapes", nargs="+", default=[f"{o}x{i}" for o, i in SHAPES], help="out x in features")
    p.add_argument("--rows", nargs="+", type=int, default=ROWS)
    args = p.parse_args()
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    rows_out = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for out_f, in_f in shapes:
            weights = [torch.randn(out_f, in_f, dtype=dtype) for _ in range(max(2, int(64e6 // (out_f * in_f * 2))))]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
            for rows in args.rows:
                x = torch.randn(rows, in_f, dtype=dtype)
                repeats = max(2, args.repeats // (4 if rows >= 512 else 1))
                plain = seconds(F.linear, x, weights, repeats)
                fast = seconds(lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), x,
                               packed, repeats)
                same = torch.equal(F.linear(x, weights[0]),
                                   torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [], ""))
                row = {"dtype": name, "shape": [out_f, in_f], "rows": rows, "f_linear_ms": plain * 1e3,
                       "packed_ms": fast * 1e3, "speedup": plain / fast, "bit_for_bit": same,
                       "packed_gb_s": out_f * in_f * weights[0].element_size() / fast / 1e9}
                rows_out.append(row)
                print(f"{name} {out_f}x{in_f} rows {rows}: F.linear {plain * 1e3:.3f} ms, packed {fast * 1e3:.3f} ms "
                      f"({plain / fast:.2f}x, {row['packed_gb_s']:.1f} GB/s), bit for bit: {same}", flush=True)
    record = {"host": machine_label(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "loadavg_1m": os.getloadavg()[0], "command": "python runs/bench/packed_linear/bench.py --dtypes "
              + " ".join(args.dtypes) + f" --repeats {args.repeats} --shapes {' '.join(args.shapes)} --rows "
              + " ".join(map(str, args.rows)), "rows": rows_out}
    with (HERE / "results.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
