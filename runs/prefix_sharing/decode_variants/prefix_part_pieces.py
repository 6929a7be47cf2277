"""A shared-prefix decode step's attention at one layer, piece by piece, at SmolLM2's shapes
(3 key-value heads of 3 query heads, 64 wide; 32 sequences past a 1,000-token prefix, 24 keys
of their own), bfloat16 on a CPU with bf16 arithmetic: the prefix part's products, exponentials
and row sums (attention._row_sums as it is, against one whole sum and against the slicing by
head rows of c30edd8), the whole prefix part, the whole call, and plain attention over the own
keys alone. Microseconds a call, the median of --rounds timings of 2,000 calls each.

    python runs/prefix_sharing/decode_variants/prefix_part_pieces.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

from flexgen_helm.executor import attention
from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import median_per_call

KV_HEADS, QUERY_HEADS, WIDTH, PREFIX, SEQUENCES, OWN, CALLS = 3, 3, 64, 1000, 32, 24, 2000


def by_head_slices(weights: torch.Tensor, limit: int = 1 << 18) -> torch.Tensor:
    """_row_sums as c30edd8 wrote it: slices of rows across the heads (each non-contiguous)."""
    g, m, n = weights.shape
    rows = max(1, limit // (g * n))
    if rows >= m:
        return weights.sum(-1, keepdim=True, dtype=torch.float32)
    total = weights.new_empty(g, m, 1, dtype=torch.float32)
    for a in range(0, m, rows):
        torch.sum(weights[:, a:a + rows], -1, keepdim=True, dtype=torch.float32, out=total[:, a:a + rows])
    return total


def micros(fn, rounds: int) -> float:
    return median_per_call(fn, CALLS, rounds, warmup=100) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not attention._bf16_matmuls_native():
        raise SystemExit("this CPU has no native bf16 matmuls: the bf16 prefix part these pieces are of "
                         "does not run here")
    torch.manual_seed(0)
    units = SEQUENCES * KV_HEADS
    q = torch.randn(units, QUERY_HEADS, 1, WIDTH).to(torch.bfloat16)
    k, v = (torch.randn(units, OWN, WIDTH).to(torch.bfloat16) for _ in range(2))
    own = torch.ones(units, OWN, dtype=torch.bool)
    prefix = attention.prefix_for_decode(torch.randn(KV_HEADS, PREFIX, WIDTH), torch.randn(KV_HEADS, PREFIX, WIDTH),
                                         torch.device("cpu"), torch.bfloat16)
    by_head, _ = attention._stacked_by_head(q.float().view(units, QUERY_HEADS, WIDTH), 0, KV_HEADS)
    qb = by_head.to(torch.bfloat16)
    scores = torch.bmm(qb, prefix.keys)
    weights = scores.clone().exp2_()
    total = attention._row_sums(weights)
    assert torch.equal(total, by_head_slices(weights)), "the two slicings sum to other bits"
    pieces = {
        "scores product (bmm)": lambda: torch.bmm(qb, prefix.keys),
        "exp2_ of the scores": lambda: scores.clone().exp2_(),
        "  (the clone alone)": lambda: scores.clone(),
        "row sums (_row_sums)": lambda: attention._row_sums(weights),
        "row sums, one call": lambda: weights.sum(-1, keepdim=True, dtype=torch.float32),
        "row sums, sliced by head rows (c30edd8)": lambda: by_head_slices(weights),
        "values product and division": lambda: torch.bmm(weights, prefix.values).div(total),
        "log-sum-exp (baddbmm)": lambda: torch.baddbmm(total.log2(), by_head, prefix.key_mean.transpose(1, 2),
                                                      beta=math.log(2)),
        "the prefix part (_bf16_prefix_part)": lambda: attention._bf16_prefix_part(by_head, prefix),
        "the whole call (attend_past_shared_prefix)": lambda: attention.attend_past_shared_prefix(
            q, k, v, own, prefix),
        "plain attention over the own keys (attend)": lambda: attention.attend(q, k, v, own, causal=False),
    }
    load = os.getloadavg()[0]
    print(f"# {machine_label()}, load {load:.2f}: us a call, median of {args.rounds} x {CALLS} calls")
    for name, fn in pieces.items():
        print(f"{name:45s} {micros(fn, args.rounds):8.1f}")


if __name__ == "__main__":
    main()
