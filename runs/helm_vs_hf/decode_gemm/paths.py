"""Every float32 product torch offers on a CPU, at decode row counts, over SmolLM2-135M's
weights streamed from memory (30 layers' 7 matrices and the head, 538 MB: more than any cache).

    python runs/helm_vs_hf/decode_gemm/paths.py [--rows 1 4 16 48 1024] [--inductor]

Paths: F.linear (x W^T); W x^T (dense_linear.py's flipped orientation), and the same with q|k|v
and gate|up fused into one matrix each; oneDNN with the weights
prepacked (`mkldnn._reorder_linear_weight`, `_linear_pointwise`); MKL's packed GEMM
(`mkl._mkl_reorder_linear_weight`, `_mkl_linear`); FBGEMM with fp16 weights (not float32
weights: for scale only); with --inductor, torch.compile's C++ GEMM template on frozen
nn.Linear modules (max_autotune, backends CPP and ATEN; one layer's 7 matrices x 30, compiled
per row count). Each path: the best of 3 passes over every weight, after one warm-up pass, as
ms a pass and GB/s: the float32 weights' bytes over that time (FBGEMM's fp16 copies are half
as many bytes; inductor's row counts the layers' matrices, without the head). Appends one JSON
line to results.jsonl beside this file, with the host, the rate of a 2048^2 product, and the
load average before and after.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.memory.machine import machine_label

HERE = Path(__file__).resolve().parent
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down
LAYERS, HEAD = 30, (49152, 576)


def best_pass(products, weights: list, rows: int) -> float:
    """Seconds of the fastest of 3 passes of `products(i, x)` over every weight."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    for i, w in enumerate(weights):
        products(i, xs[w.shape[1]])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i, w in enumerate(weights):
            products(i, xs[w.shape[1]])
        best = min(best, time.perf_counter() - t0)
    return best


def fused_weights(weights: list) -> list:
    """Per weight of `weights`, the fused matrix whose product replaces it (q|k|v at q's place,
    gate|up at gate's, the rest as they are) or None where a fused product already covers it."""
    out = []
    for layer in range(LAYERS):
        q, k, v, o, gate, up, down = weights[layer * len(LAYER):(layer + 1) * len(LAYER)]
        out += [torch.cat([q, k, v]), None, None, o, torch.cat([gate, up]), None, down]
    return out + [weights[-1]]


def square_peak() -> float:
    """FLOP/s of a 2048 x 2048 float32 product: this CPU's GEMM rate where no weight streams."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048**3 / (time.perf_counter() - t0)


def aten_paths(weights: list, rows: int) -> dict:
    fused = fused_weights(weights)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    fp16 = [torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(w) for w in weights]
    zeros = [torch.zeros(w.shape[0]) for w in weights]
    paths = {
        "F.linear": lambda i, x: F.linear(x, weights[i]),
        # q|k|v and gate|up as one matrix each: 4 products a layer instead of 7, the same bytes
        "W x^T, fused": lambda i, x: fused[i] @ x.t() if fused[i] is not None else None,
        "W x^T": lambda i, x: weights[i] @ x.t(),
        "oneDNN prepacked": lambda i, x: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "MKL packed": lambda i, x: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, rows),
        "FBGEMM fp16 weights": lambda i, x: torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation(
            x, fp16[i], zeros[i]),
    }
    return {name: best_pass(fn, weights, rows) for name, fn in paths.items()}


def inductor_path(rows: int) -> tuple[float, int]:
    """Seconds a pass of the C++ template's products over 30 layers' matrices, and their bytes."""
    inductor = importlib.import_module("torch._inductor.config")  # torch.compile's documented settings
    inductor.max_autotune, inductor.max_autotune_gemm_backends, inductor.freezing = True, "CPP,ATEN", True
    linears = torch.nn.ModuleList([torch.nn.Linear(i, o, bias=False) for _ in range(LAYERS) for o, i in LAYER]).eval()
    widths = sorted({m.in_features for m in linears})

    class AllProducts(torch.nn.Module):
        def forward(self, xs: dict) -> list:
            return [m(xs[m.in_features]) for m in linears]

    with torch.no_grad():
        compiled = torch.compile(AllProducts())
        xs = {w: torch.randn(rows, w) for w in widths}
        compiled(xs)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            compiled(xs)
            best = min(best, time.perf_counter() - t0)
    return best, sum(m.weight.numel() * 4 for m in linears)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 48, 1024])
    p.add_argument("--inductor", action="store_true", help="also torch.compile's C++ GEMM template (minutes)")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    torch.manual_seed(0)
    weights = [torch.randn(o, i) for _ in range(LAYERS) for o, i in LAYER] + [torch.randn(*HEAD)]
    nbytes = sum(w.numel() * 4 for w in weights)
    record = {"host": machine_label(), "threads": torch.get_num_threads(), "weight_mb": round(nbytes / 1e6, 1),
              "square_2048_gflop_per_s": round(square_peak() / 1e9, 1), "rows": {}}
    for rows in args.rows:
        times = aten_paths(weights, rows)
        row = {name: {"ms": round(s * 1e3, 1), "gb_per_s": round(nbytes / s / 1e9, 2)} for name, s in times.items()}
        if args.inductor:
            s, layer_bytes = inductor_path(rows)
            row["inductor C++ template (layers only)"] = {"ms": round(s * 1e3, 1),
                                                           "gb_per_s": round(layer_bytes / s / 1e9, 2)}
        record["rows"][rows] = row
        print(rows, json.dumps(row), flush=True)
    record["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    record["command"] = ("python runs/helm_vs_hf/decode_gemm/paths.py --rows " + " ".join(map(str, args.rows))
                         + (" --inductor" if args.inductor else ""))
    with open(HERE / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
