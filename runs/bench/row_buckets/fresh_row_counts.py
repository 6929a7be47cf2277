"""A bf16 product on a row count not met before against the same counts met again, bare (no
engine): F.linear on a plain weight, on a weight stored by column (a 4-bit weight's dense copy),
and on a prepacked one (dense_linear.PackedLinear), at SmolLM2's and OLMoE's weight shapes;
and OLMoE's expert shape with the rows padded to 16 counts an octave (models/moe.padded_row_count).

    python runs/bench/row_buckets/fresh_row_counts.py

Prints ms per call: "fresh" (each count new to the process), "same" (one count, met before).
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from flexgen_helm.models.moe import padded_row_count


def ms_per_call(fn, rows: list[int]) -> float:
    t0 = time.perf_counter()
    for m in rows:
        fn(m)
    return (time.perf_counter() - t0) / len(rows) * 1e3


def main() -> None:
    from flexgen_helm.memory.machine import machine_label

    print(f"# {machine_label()}, torch {torch.__version__}")
    random.seed(3)
    pool = list(range(300, 2900))
    random.shuffle(pool)
    for n, k in ((576, 576), (1536, 576), (576, 1536), (1024, 2048)):
        w = torch.randn(n, k, dtype=torch.bfloat16)
        by_column = torch.randn(k, n, dtype=torch.bfloat16).t()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        x = torch.randn(3000, k, dtype=torch.bfloat16)
        fns = {"plain": lambda m, w=w, x=x: F.linear(x[:m], w),
               "by column": lambda m, w=by_column, x=x: F.linear(x[:m], w),
               "packed": lambda m, p=packed, x=x: torch.ops.mkldnn._linear_pointwise(x[:m], p, None, "none", [], "")}
        line = []
        for name, fn in fns.items():
            fn(1500)
            fresh = [pool.pop() for _ in range(15)]
            same = [sorted(fresh)[7]] * 15
            fn(same[0])
            line.append(f"{name}: fresh {ms_per_call(fn, fresh):.2f} same {ms_per_call(fn, same):.2f}")
        print((n, k), " | ".join(line), flush=True)
    w = torch.randn(2048, 1024, dtype=torch.bfloat16).t()  # OLMoE's gate/up, by column
    x = torch.randn(3000, 2048, dtype=torch.bfloat16)
    pool = list(range(600, 1500))
    random.shuffle(pool)
    for r in range(4):
        fresh = [pool.pop() for _ in range(20)]
        bare = ms_per_call(lambda m: F.linear(x[:m], w), fresh)
        padded = ms_per_call(lambda m: F.linear(x[:padded_row_count(m)], w), fresh)
        print(f"round {r}, 600-1500 rows, by column: fresh counts {bare:.2f} ms, padded {padded:.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
