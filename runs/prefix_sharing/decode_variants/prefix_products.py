"""The shared prefix's two products of a decode step at SmolLM2's shapes (3 kv heads, 96
queries = 32 sequences x 3 query heads, 1,000 prefix keys, head dim 64, bf16): torch.bmm
over the DecodePrefix layout (what attention._bf16_prefix_part runs) against the prefix's
keys and values held as oneDNN-packed weights (dense_linear.PackedLinear, one product per kv
head) and as plain F.linear weights. Median of 200 calls, us; the outputs' bits compared.

    python runs/prefix_sharing/decode_variants/prefix_products.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from flexgen_helm.dense_linear import PackedLinear
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import median_seconds

KV_HEADS, QUERIES, PREFIX, D = 3, 96, 1000, 64


def main() -> None:
    keep_freed_host_memory()
    bf = torch.bfloat16
    q = torch.randn(KV_HEADS, QUERIES, D).to(bf)
    keys_t = torch.randn(KV_HEADS, D, PREFIX).to(bf).contiguous()  # DecodePrefix's (kv_heads, d, P)
    values = torch.randn(KV_HEADS, PREFIX, D).to(bf)
    weights = torch.rand(KV_HEADS, QUERIES, PREFIX).to(bf)
    keys = [keys_t[h].t().contiguous() for h in range(KV_HEADS)]  # (P, d): a linear weight, out = P
    values_t = [values[h].t().contiguous() for h in range(KV_HEADS)]  # (d, P): out = d
    packed_keys, packed_values = [PackedLinear(x) for x in keys], [PackedLinear(x) for x in values_t]
    runs = {
        "scores, bmm": lambda: torch.bmm(q, keys_t),
        "scores, packed": lambda: torch.stack([packed_keys[h].linear(q[h]) for h in range(KV_HEADS)]),
        "scores, F.linear": lambda: torch.stack([torch.nn.functional.linear(q[h], keys[h]) for h in range(KV_HEADS)]),
        "output, bmm": lambda: torch.bmm(weights, values),
        "output, packed": lambda: torch.stack([packed_values[h].linear(weights[h]) for h in range(KV_HEADS)]),
    }
    print(f"# {machine_label()}: the prefix's products of a decode step, bf16, 2 threads")
    for name, fn in runs.items():
        fn()
        print(f"{name:18s} {median_seconds(fn, 200) * 1e6:6.1f} us")
    print("scores equal:", torch.equal(runs["scores, bmm"](), runs["scores, packed"]()),
          " outputs equal:", torch.equal(runs["output, bmm"](), runs["output, packed"]()))


if __name__ == "__main__":
    main()
