"""Tried, not adopted: the gated MLP's activation and product in place (F.silu(inplace=True),
mul_) against models/gated_mlp's, on prepacked bf16 weights of SmolLM2's shapes, with freed
memory kept as the engine keeps it; 8 alternating rounds per row count.

    python runs/helm_vs_hf/natural_parts/tried/mlp_in_place.py
"""

import time

import torch
import torch.nn.functional as F

from flexgen_helm.dense_linear import PackedLinear
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.models.gated_mlp import gated_mlp


def in_place(x, gate, up, down):
    a = gate.linear(x)
    F.silu(a, inplace=True)
    return down.linear(a.mul_(up.linear(x)))


def main() -> None:
    keep_freed_host_memory()
    torch.manual_seed(0)
    for rows in (6720, 1000, 64):
        shapes = ((1536, 576), (1536, 576), (576, 1536))
        gate, up, down = (PackedLinear(torch.randn(*s).to(torch.bfloat16)) for s in shapes)
        x = torch.randn(rows, 576).to(torch.bfloat16)
        sides = {"current": lambda x=x, g=gate, u=up, d=down: gated_mlp(x, g, u, d, "silu"),
                 "in place": lambda x=x, g=gate, u=up, d=down: in_place(x, g, u, d)}
        assert torch.equal(sides["current"](), sides["in place"]())
        calls = max(5, 200000 // rows)
        ratios = []
        for rnd in range(8):
            ms = {}
            for name in (("current", "in place") if rnd % 2 else ("in place", "current")):
                sides[name]()
                t0 = time.perf_counter()
                for _ in range(calls):
                    sides[name]()
                ms[name] = (time.perf_counter() - t0) / calls * 1e3
            ratios.append(ms["in place"] / ms["current"])
        ratios.sort()
        print(f"{rows} rows: in place / current, median {ratios[4]:.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
