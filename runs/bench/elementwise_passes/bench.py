"""What a block's elementwise ops cost in units of the hardware profile's plain pass (the
cost model's ELEMENTWISE_PASSES and the counts beside it, planner/cost_model.py): each op as
the engine runs it, at a prefill's shapes, timed alone, divided by the time of one plain pass
(planner/hardware_profile.measure_elementwise_rate) over as many elements.

    python runs/bench/elementwise_passes/bench.py [--dtype bfloat16] [--tokens 4096]

Widths: OLMoE-1B-7B's (hidden 2048, 16 heads of 128, experts of 1024, k = 8) and
SmolLM2-135M's (hidden 576, 9 query and 3 key-value heads of 64, MLP 1536).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.models.gated_mlp import ACTIVATIONS
from flexgen_helm.models.norms import rms_norm
from flexgen_helm.models.rotary import Rotary
from flexgen_helm.planner.hardware_profile import measure_elementwise_rate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from record import median_seconds

MODELS = {  # hidden, query heads, kv heads, head dim, MLP width (one expert's), experts per token, experts
    "olmoe-1b-7b": (2048, 16, 16, 128, 1024, 8, 64),
    "smollm2-135m": (576, 9, 3, 64, 1536, 0, 0),
}


def routing(x: torch.Tensor, k: int, experts: int) -> None:
    """models/moe.expert_mlp's passes over the hidden size per (token, choice), its products
    left out: each expert's rows gathered, its output (here the rows themselves) times their
    routing weights, added back to their tokens."""
    n = x.shape[0]
    chosen = torch.randint(0, experts, (n, k))
    order = torch.argsort(chosen.reshape(-1), stable=True)
    counts = torch.bincount(chosen.reshape(-1), minlength=experts).tolist()
    rows, weights = order // k, torch.rand(n * k, dtype=x.dtype)[order]
    out = torch.zeros_like(x)
    start = 0
    for count in counts:
        picked = rows[start:start + count]
        y = x.index_select(0, picked)
        out.index_add_(0, picked, y * weights[start:start + count, None])
        start += count


def model_ops(dtype: torch.dtype, n: int, hidden: int, heads: int, kv_heads: int, d: int, mlp: int, k: int,
              experts: int) -> dict:
    """The block's elementwise ops over n tokens of one geometry: op -> (call, elements a token)."""
    x = torch.randn(n, hidden).to(dtype)
    weight = torch.rand(hidden).to(dtype)
    seqs = max(1, n // 512)
    rotary = Rotary.table(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 1.0, 512, "cpu", dtype)
    at = rotary.at(torch.arange(n // seqs)[None, :].expand(seqs, -1))
    q = torch.randn(seqs, heads, n // seqs, d).to(dtype)
    kk = torch.randn(seqs, kv_heads, n // seqs, d).to(dtype)
    width = mlp * (k or 1)
    gate, up = torch.randn(n, width).to(dtype), torch.randn(n, width).to(dtype)
    ops = {
        "rms_norm (hidden)": (lambda: rms_norm(x, weight, 1e-5), hidden),
        "rotary (q and k heads)": (lambda: (at.apply(q), at.apply(kk)), (heads + kv_heads) * d),
        "silu(gate) * up (MLP width)": (lambda: ACTIVATIONS["silu"](gate) * up, width),
        "residual add (hidden)": (lambda: x + x, hidden),
    }
    if k:
        ops["routing, per choice (k x hidden)"] = (lambda: routing(x, k, experts), k * hidden)
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tokens", type=int, default=4096, help="rows of a prefill's GPU batch (sequences x prompt)")
    args = p.parse_args()
    keep_freed_host_memory()
    dtype, n = getattr(torch, args.dtype), args.tokens
    rate = measure_elementwise_rate(torch.device("cpu"), dtype)
    print(f"# {machine_label()}, {args.dtype}, {n} tokens: plain pass {rate / 1e9:.2f} G elements/s")
    print("| model | op | elements a token | ms | passes |\n|---|---|---:|---:|---:|")
    for name, geometry in MODELS.items():
        for op, (fn, per_token) in model_ops(dtype, n, *geometry).items():
            fn()
            seconds = median_seconds(fn, 9)
            print(f"| {name} | {op} | {per_token:,} | {seconds * 1e3:.2f} | {seconds * rate / (n * per_token):.1f} |")


if __name__ == "__main__":
    main()
