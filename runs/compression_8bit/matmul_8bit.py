"""8-bit weights against bf16, one block's linears at a time, per activation row count (decode
rows 1-64, prefill rows 128-4096): which 8-bit path could pay, and where.

Paths timed (all in bfloat16 activations, summed over one block's linears of the model):
- bf16: F.linear on the bf16 weight (the BF16 deployment's matmul).
- g64 dequant+mm: today's 8-bit path: the group-wise 8-bit weight (groups of 64 along the
  input dim, min/max) dequantized (compression/quantize.dequantize), then F.linear; what every
  use of a layer pays now.
- g64 copy reused: F.linear on a dense copy made once per block and reused by its decode steps
  (the dequantization amortized away: the ceiling of that path is bf16's own time).
- int8pack (per channel): torch.ops.aten._weight_int8pack_mm on int8 codes with one bfloat16
  scale per output channel (symmetric, the grid that op takes: NOT the g64 grid), the affine
  minimum added back as one outer product (w = (q - 128) s + z per row: y = int8mm + x.sum z).
- w8a8 int_mm (per channel): the same per-channel codes times int8 activations (each row
  quantized symmetrically on its own max |x| after a per-channel smoothing multiply, as
  SmoothQuant's x / s), torch._int_mm (int8 x int8 -> int32) and a float32 epilogue
  acc * a * scale + sum(x / s) * zero: the W8A8 path w8a8_accuracy.py simulates, on every linear.
- w8a8, last weight-only: the block's last linear (down_proj / fc2) left to bf16's F.linear
  (the ceiling of a weight-only path there: a dense copy), the others as w8a8 int_mm; the
  configuration that kept WikiText within 1% of weight-only 8-bit on SmolLM2 (README).
The grids' errors are printed beside (max |w - w_hat| / max |w| on random normal weights), as
the per-channel grid is coarser than g64.

    PYTHONPATH=. python runs/compression_8bit/matmul_8bit.py [--model smollm2-135m|opt-1.3b] \\
        [--repeats 5] [--rows 1 8 32 64 128 512 2048] [--json runs/compression_8bit/<host>.json]

Warm-up call first, then the median of `repeats`; /proc/loadavg before and after, and the
host (memory.machine.machine_label) go into the JSON. Timings need the machine alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.compression.quantize import dequantize, quantize
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy.policy import Compression

LAYERS = {  # (out, in) of a block's linears
    "opt-1.3b": [(2048, 2048)] * 4 + [(8192, 2048), (2048, 8192)],
    "smollm2-135m": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)],
}
ROWS = (1, 8, 32, 64, 128, 512, 2048)


def median_s(fn, repeats: int) -> float:
    """Seconds of one call: a warm-up call, then the median of `repeats` timed ones."""
    fn()
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def per_channel_int8(w: torch.Tensor):
    """Asymmetric min/max per output row at 8 bits as _weight_int8pack_mm takes it: int8 codes
    q - 128, a bfloat16 scale per row, and the row's zero z = min + 128 scale apart."""
    wf = w.float()
    lo, hi = wf.amin(1), wf.amax(1)
    scale = ((hi - lo) / 255).clamp_min(1e-12).to(torch.bfloat16).float()
    codes = ((wf - lo[:, None]) / scale[:, None]).round().clamp(0, 255)
    zero = (lo + 128 * scale).to(torch.bfloat16)
    q = (codes - 128).to(torch.int8).contiguous()
    w_hat = (q.float() * scale[:, None] + zero.float()[:, None])
    return q, scale.to(torch.bfloat16), zero, w_hat


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scale) + x.sum(-1, keepdim=True) * zero


def w8a8_linear(x: torch.Tensor, q_t: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                inv_s: torch.Tensor) -> torch.Tensor:
    """W8A8 (module doc): q_t the (in, out) int8 codes, scale and zero float32 per output row,
    inv_s the smoothing's 1 / s per input channel."""
    xs = x.float().mul_(inv_s)
    a = xs.abs().amax(-1, keepdim=True).clamp_min_(1e-8).div_(127)
    qx = (xs / a).round_().clamp_(-127, 127).to(torch.int8)
    acc = torch._int_mm(qx, q_t).float()
    return acc.mul_(a).mul_(scale).addcmul_(xs.sum(-1, keepdim=True), zero).to(x.dtype)


def measure(model: str, rows: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    dense = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in LAYERS[model]]
    g64 = [quantize(w, Compression(8, 64, 1), 1) for w in dense]
    chan = [per_channel_int8(w) for w in dense]
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
    errors = {"g64": max(rel(dequantize(q, torch.float32), w) for q, w in zip(g64, dense)),
              "per_channel": max(rel(c[3], w) for c, w in zip(chan, dense))}
    copies = [dequantize(q, torch.bfloat16) for q in g64]
    # int8 x int8: codes transposed once (as a store would keep them), epilogue factors in float32
    w8a8 = [(c[0].t().contiguous().t(), c[1].float(), c[2].float(), torch.rand(w.shape[1]) + 0.5)
            for c, w in zip(chan, dense)]
    out = {}
    for m in rows:
        xs = [torch.randn(m, w.shape[1], dtype=torch.bfloat16) for w in dense]
        row = {
            "bf16": sum(median_s(lambda w=w, x=x: F.linear(x, w), repeats) for w, x in zip(dense, xs)),
            "g64_dequant_mm": sum(median_s(lambda q=q, x=x: F.linear(x, dequantize(q, torch.bfloat16)), repeats)
                                  for q, x in zip(g64, xs)),
            "g64_copy_reused": sum(median_s(lambda d=d, x=x: F.linear(x, d), repeats) for d, x in zip(copies, xs)),
            "int8pack_per_channel": sum(median_s(lambda c=c, x=x: int8_linear(x, c[0], c[1], c[2]), repeats)
                                        for c, x in zip(chan, xs)),
        }
        w8a8_each = [median_s(lambda c=c, x=x: w8a8_linear(x, c[0].t(), c[1], c[2], c[3]), repeats)
                     for c, x in zip(w8a8, xs)]
        row["w8a8_int_mm"] = sum(w8a8_each)
        row["w8a8_last_weight_only"] = sum(w8a8_each[:-1]) + median_s(
            lambda x=xs[-1], w=dense[-1]: F.linear(x, w), repeats)
        row.update({f"{k}_vs_bf16": row["bf16"] / row[k] for k in list(row) if k != "bf16"})
        out[m] = row
        print(f"{model} rows {m:5d}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in row.items()
                                                       if not k.endswith("_vs_bf16"))
              + " | speed vs bf16: " + ", ".join(f"{k.removesuffix('_vs_bf16')} {v:.2f}x" for k, v in row.items()
                                                   if k.endswith("_vs_bf16")), flush=True)
    return {"rows": out, "grid_max_rel_error": errors}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(LAYERS), default="smollm2-135m")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    result = measure(args.model, args.rows, args.repeats)
    record = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "host": machine_label(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "model": args.model,
              "repeats": args.repeats, "load_average": {"before": load_before, "after": os.getloadavg()}, **result}
    print("grid max |w - w_hat| / max |w|:", result["grid_max_rel_error"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
