"""The ceiling of natural-easy's MLP on this host: SmolLM2's gated MLP (576 -> 1536 -> 576) on
prepacked bf16 weights over 6,720 rows (a GPU batch of 64 suffixes of 105 tokens), bare, with
freed memory kept as the engine keeps it; and its gate product alone. 4 rounds of 10 calls.

    python runs/helm_vs_hf/natural_parts/mlp_ceiling.py
"""

import time

import torch

from flexgen_helm.dense_linear import PackedLinear
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.models.gated_mlp import gated_mlp

ROWS = 6720


def main() -> None:
    keep_freed_host_memory()
    torch.manual_seed(0)
    gate, up, down = (PackedLinear(torch.randn(*s).to(torch.bfloat16)) for s in ((1536, 576), (1536, 576), (576, 1536)))
    x = torch.randn(ROWS, 576).to(torch.bfloat16)
    product = ROWS * 576 * 1536 * 2
    print(f"# {machine_label()}")
    for r in range(4):
        gated_mlp(x, gate, up, down, "silu")
        t0 = time.perf_counter()
        for _ in range(10):
            gated_mlp(x, gate, up, down, "silu")
        mlp = (time.perf_counter() - t0) / 10
        t0 = time.perf_counter()
        for _ in range(10):
            gate.linear(x)
        one = (time.perf_counter() - t0) / 10
        print(f"round {r}: MLP {mlp * 1e3:.1f} ms, {3 * product / mlp / 1e9:.0f} GFLOP/s; "
              f"its gate product alone {one * 1e3:.2f} ms, {product / one / 1e9:.0f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
