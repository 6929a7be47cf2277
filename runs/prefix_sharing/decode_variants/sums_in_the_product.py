"""A prefill window's prefix part on our bf16 products (attention._bf16_prefix_part) with the
weights' row sums taken apart in float32 (_row_sums, as before) or out of the product with the
values, as one more column of ones (values_and_ones, rounded to bf16 with the product): at a
few-shot HELM scenario's window shapes (SmolLM2: 3 kv heads, 3 query heads a kv head; 302
prefix keys, 89 own positions a row; 8 and 64 rows), the queries sliced as
attention._window_prefix_part slices them (WINDOW_MAX_SCORES). Each way timed over the
window's slices, in 20 rounds of both in turn: the medians and the median of the rounds' ratios;
and each way's largest difference from float64 attention (output, log-sum-exp).

    python runs/prefix_sharing/decode_variants/sums_in_the_product.py
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import sys
from pathlib import Path

import torch

from flexgen_helm.executor import attention
from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from record import interleaved_per_call

KV_HEADS, QUERY_HEADS, WIDTH, PREFIX, OWN = 3, 3, 64, 302, 89


def main() -> None:
    torch.manual_seed(0)
    attention.set_fused_prefix_part("cpu", ())
    keys, values = torch.randn(KV_HEADS, PREFIX, WIDTH) * 1.5 + 0.5, torch.randn(KV_HEADS, PREFIX, WIDTH)
    prefix = attention.prefix_for_decode(keys, values, torch.device("cpu"), torch.bfloat16, use="window")
    if prefix.key_mean is None:
        raise SystemExit("this CPU has no native bf16 matmuls: the bf16 layout this measures is not made here")
    with_ones = attention._values_and_ones(prefix.values)
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}")
    for rows in (8, 64):
        queries = rows * QUERY_HEADS * OWN
        q = torch.randn(KV_HEADS, queries, WIDTH)
        step = max(1, attention.WINDOW_MAX_SCORES // (KV_HEADS * PREFIX))

        def part(ones, q=q, step=step):
            return [attention._bf16_prefix_part(q[:, a:a + step], prefix, ones) for a in range(0, q.shape[1], step)]

        ways = {"sums apart (float32)": functools.partial(part, None),
                "sums in the product (bf16)": functools.partial(part, with_ones)}
        scores = q.double() @ keys.double().transpose(1, 2) / math.sqrt(WIDTH)
        want, want_lse = scores.softmax(-1) @ values.double(), scores.logsumexp(-1, keepdim=True)
        times = interleaved_per_call(ways, calls=3, rounds=20, warmup=2)
        for name, fn in ways.items():
            out, lse = (torch.cat(x, 1).double() for x in zip(*fn()))
            ms = statistics.median(times[name]) * 1e3
            print(f"{rows:3} rows, {queries:6} queries a kv head: {name:27} {ms:7.2f} ms  max error: output "
                  f"{(out - want).abs().max():.5f}, log-sum-exp {(lse - want_lse).abs().max():.5f}")
        apart, inside = times.values()
        ratio = statistics.median(a / b for a, b in zip(apart, inside))
        print(f"    apart over in the product, the rounds' median: {ratio:.3f}x")


if __name__ == "__main__":
    main()
