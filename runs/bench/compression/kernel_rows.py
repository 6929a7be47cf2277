"""Where a compressed weight's kernel beats the bf16 copy held in oneDNN's layout, per
activation rows and per SmolLM2-135M shape (its block's linears and its tied head): torch's
int4 kernel (`_weight_int4pack_mm_for_cpu`, groups of 32 as the bundled GGUF's codes), the
int8 kernel alone (`_weight_int8pack_mm`, per output channel) and with the per-channel grid's
zero term (compression/int8.int8_mm, as the engine runs it), against PackedLinear
(dense_linear.py). Each shape's weights are copies enough to stream from memory, as a decode
step's do (one weight read again would sit in the CPU's caches); microseconds per call, the
median of --rounds after a warm-up.

    python runs/bench/compression/kernel_rows.py [--threads 2] [--rounds 5]

Appends one JSON line to kernel_rows.jsonl beside this file (host, load, command) and prints
a table. Written for issue 48: the main job's LAMBADA decodes 10 rows a step, its
pattern_match 6 (after its short answers stop), and which of the three paths pays there
decides whether a compressed deployment can be faster than BF16.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from flexgen_helm.compression.int4 import pack_int4
from flexgen_helm.compression.int8 import int8_mm, pack_int8
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.dense_linear import PackedLinear, packs_linear_weights
from flexgen_helm.policy.policy import PER_CHANNEL, Compression

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from record import append_record, bench_args, median_seconds  # noqa: E402

SHAPES = {"q, o (576 x 576)": (576, 576), "k, v (192 x 576)": (192, 576), "gate, up (1536 x 576)": (1536, 576),
          "down (576 x 1536)": (576, 1536), "tied head (49152 x 576)": (49152, 576)}
ROWS = (1, 2, 4, 6, 8, 10, 16, 32)
STREAMED_BYTES = 256 << 20  # of bf16 weights per shape: several times this host's 32 MiB L3


def _each(product, x: torch.Tensor, weights: list) -> None:
    for w in weights:
        product(x, w)


def _held(x, w):
    return w.linear(x)


def _int4(x, p):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, p.packed, p.group_size, p.scales_zeros)


def _int8_alone(x, p):
    return torch.ops.aten._weight_int8pack_mm(x, p.packed, p.scales)


def _int8_with_zero(x, p):
    return int8_mm(x, p)


def main() -> None:
    args = bench_args(__doc__, HERE, rounds=5)
    args.out = HERE / "kernel_rows.jsonl" if args.out.name == "results.jsonl" else args.out
    if not packs_linear_weights(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("this CPU holds no bf16 weights in oneDNN's layout (no native bf16 matmuls): "
                         "the held copy this bench compares against does not run here")
    load = os.getloadavg()[0]
    table = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, STREAMED_BYTES // (2 * n * k))
        ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
        held = [PackedLinear(w) for w in ws]
        int4 = [pack_int4(quantize(w, Compression(4, 32), 1), torch.device("cpu")) for w in ws]
        int8 = [pack_int8(quantize(w, Compression(8, PER_CHANNEL), 1), torch.bfloat16) for w in ws]
        del ws
        table[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, k).to(torch.bfloat16)
            paths = {"held bf16": (_held, held), "int4": (_int4, int4), "int8 alone": (_int8_alone, int8),
                     "int8 + zero term": (_int8_with_zero, int8)}
            table[name][rows] = {path: round(median_seconds(functools.partial(_each, fn, x, ws), args.rounds)
                                             / copies * 1e6, 1) for path, (fn, ws) in paths.items()}
        print(f"{name} ({copies} copies), us a call; speed over the held bf16 copy:")
        for rows, us in table[name].items():
            print(f"  {rows:3d} rows: " + ", ".join(
                f"{path} {t:.1f}" + ("" if path == "held bf16" else f" ({us['held bf16'] / t:.2f}x)")
                for path, t in us.items()))
    append_record(args.out, {"us_per_call": table}, load,
                  f"python runs/bench/compression/kernel_rows.py --threads {args.threads} --rounds {args.rounds}",
                  threads=args.threads, rounds=args.rounds)


if __name__ == "__main__":
    main()
