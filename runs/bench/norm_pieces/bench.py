"""RMSNorm of a prefill's hidden state whole against in pieces of rows (models/norms.py), and
rotary embeddings of its heads whole against in pieces of positions (models/rotary.py), bf16
and float32, one process; every output compared bit for bit.

    python runs/bench/norm_pieces/bench.py --out runs/bench/norm_pieces/results.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.models import cache_pieces, norms, rotary


def whole(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    keep_freed_host_memory()  # as the engine runs
    host = f"{machine_label()}, torch {torch.__version__}"
    with open(args.out, "a") as f:
        for dtype in (torch.bfloat16, torch.float32):
            for rows, width in ((8192, 2048), (4096, 2048), (2048, 576), (512, 4096)):
                x = torch.randn(rows, width).to(dtype)
                w = torch.randn(width).to(dtype)
                same = torch.equal(norms.rms_norm(x, w, 1e-5), whole(x, w, 1e-5))
                t_whole = best_ms(functools.partial(whole, x, w, 1e-5), args.repeats)
                t_pieces = best_ms(functools.partial(norms.rms_norm, x, w, 1e-5), args.repeats)
                row = {"op": "rms_norm", "dtype": str(dtype), "rows": rows, "width": width,
                       "whole_ms": round(t_whole, 3),
                       "pieces_ms": round(t_pieces, 3), "speedup": round(t_whole / t_pieces, 2), "bit_equal": same,
                       "load_1m": os.getloadavg()[0], "host": host,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                print(row)
                f.write(json.dumps(row) + "\n")
            for b, heads, positions in ((8, 16, 512), (1, 9, 4096), (4, 9, 256)):
                inv = 1.0 / (10000 ** (torch.arange(0, 128, 2).float() / 128))
                table = rotary.Rotary.table(inv, 1.0, positions, "cpu", dtype)
                at = table.at(torch.arange(positions)[None].expand(b, -1))
                x = torch.randn(b, heads, positions, 128).to(dtype)
                pieces = at.apply(x)
                t_pieces = best_ms(functools.partial(at.apply, x), args.repeats)
                with_pieces_from = cache_pieces.PIECED_FROM
                cache_pieces.PIECED_FROM = x.numel()
                same = torch.equal(at.apply(x), pieces)
                t_whole = best_ms(functools.partial(at.apply, x), args.repeats)
                cache_pieces.PIECED_FROM = with_pieces_from
                row = {"op": "rotary", "dtype": str(dtype), "shape": list(x.shape), "whole_ms": round(t_whole, 3),
                       "pieces_ms": round(t_pieces, 3), "speedup": round(t_whole / t_pieces, 2), "bit_equal": same,
                       "load_1m": os.getloadavg()[0], "host": host,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                print(row)
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
