"""Where the int4 kernel stops paying: per activation row count, the CPU kernel on packed
weights against dequantize-then-matmul (one dequantization plus a bf16 matmul), summed over
one block's linears of OPT-1.3B and of SmolLM2-135M. Chooses compression/int4.py's
MAX_KERNEL_ROWS["cpu"]: the largest row count at which the kernel is still faster for both.

    PYTHONPATH=. python runs/bench/compression/kernel_crossover.py [--repeats 5] [--json out.json]

Warm-up call first, then the median of `repeats`; /proc/loadavg before and after (other
work on the machine shows there, and ratios taken in one run are what to compare).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.compression.int4 import CompressedWeight, pack_int4
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.policy.policy import Compression

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from record import median_seconds

LAYERS = {  # (out, in) of a block's linears
    "opt-1.3b": [(2048, 2048)] * 4 + [(8192, 2048), (2048, 8192)],
    "smollm2-135m": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)],
}
ROWS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048)


def weights(shapes, group_size: int) -> list[CompressedWeight]:
    out = []
    for n, k in shapes:
        q = quantize(torch.randn(n, k, dtype=torch.bfloat16), Compression(4, group_size, 1), 1)
        out.append(CompressedWeight([(0, pack_int4(q, torch.device("cpu")))], (n, k), torch.bfloat16, None))
    return out


def measure(model: str, group_size: int, repeats: int) -> dict:
    ws = weights(LAYERS[model], group_size)
    dequant = sum(median_seconds(lambda w=w: (setattr(w, "_dense", None), w.dense()), repeats) for w in ws)
    dense = [w.dense() for w in ws]
    rows = {}
    for m in ROWS:
        xs = [torch.randn(m, w.shape[1], dtype=torch.bfloat16) for w in ws]
        kernel = sum(median_seconds(lambda w=w, x=x: w.linear(x), repeats) for w, x in zip(ws, xs))
        matmul = sum(median_seconds(lambda d=d, x=x: F.linear(x, d), repeats) for d, x in zip(dense, xs))
        rows[m] = {"kernel_ms": kernel * 1e3, "bf16_matmul_ms": matmul * 1e3,
                   "dequantize_then_matmul_ms": (dequant + matmul) * 1e3}
        print(f"{model:14s} rows {m:5d}: kernel {kernel * 1e3:8.2f} ms  bf16 matmul {matmul * 1e3:8.2f} ms  "
              f"dequantize+matmul {(dequant + matmul) * 1e3:8.2f} ms", flush=True)
    return {"dequantize_ms": dequant * 1e3, "rows": rows}


def crossover(results: dict) -> int:
    """The largest row count up to which the kernel wins for every model."""
    best = 0
    for m in ROWS:
        if all(r["rows"][m]["kernel_ms"] <= r["rows"][m]["dequantize_then_matmul_ms"] for r in results.values()):
            best = m
        else:
            break
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    load_start = Path("/proc/loadavg").read_text().strip()
    results = {m: measure(m, args.group_size, args.repeats) for m in LAYERS}
    load_end = Path("/proc/loadavg").read_text().strip()
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "group_size": args.group_size,
           "repeats": args.repeats, "loadavg_start": load_start, "loadavg_end": load_end,
           "results": results, "crossover_rows": crossover(results)}
    print(f"loadavg start {load_start} | end {load_end}")
    print(f"crossover: the kernel wins up to {out['crossover_rows']} rows")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
