"""A bf16 CPU decode step's attention on its two paths (executor/attention.attend): the float32
products (whole or a piece of positions at a time, as the engine picks) against torch's fused
kernel (attention.fused_decode, which `flexgen-helm profile` chooses from the cache length
where it measured it faster), at the engine's shapes: OLMoE-1B-7B's GPU batch of 8 past a 512-token prompt (the
olmoe-1b-7b-p512-g32 compare row), SmolLM2's 32 sequences of a shared-prefix block's own keys
and of whole 200- and 1,000-token caches, and OPT-1.3B's profile shape. Eight layers' caches
(the slot's position-major layout, read in place) are attended in turn, as a decode step does;
ms per layer, each path's time the median of --rounds passes taken in turns, and the ratio of
each pair; plus the largest error of each path against float64 attention, in units of the
output's bf16 step.

    python runs/bench/decode_attention_paths/bench.py [--threads 2] [--rounds 7]
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from flexgen_helm.executor import attention
from flexgen_helm.memory.host_allocator import keep_freed_host_memory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from record import append_record, bench_args  # noqa: E402

# (name, units, query heads a unit, head dim, keys)
SHAPES = (("olmoe gbs 8, 544 keys", 128, 1, 128, 544), ("smollm2 32 seqs, 24 own keys", 96, 3, 64, 24),
          ("smollm2 32 seqs, 200 keys", 96, 3, 64, 200), ("smollm2 32 seqs, 1000 keys", 96, 3, 64, 1000),
          ("profile shape (opt-like)", 256, 1, 64, 513))
LAYERS = 8


def step(q, caches, valid):
    for k, v in caches:
        attention.attend(q, k, v, valid, causal=False)


def on_path(fused: bool, fn):
    before = attention.set_fused_decode("cpu", 1 if fused else None)
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        attention.set_fused_decode("cpu", before)


def error_steps(out: torch.Tensor, q, k, v, valid) -> float:
    """The largest |out - exact| in bf16 steps of the exact output's magnitude (at least 2^-8)."""
    scores = torch.einsum("urd,utd->urt", q[:, :, 0].double(), k.double()) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1)
    exact = torch.einsum("urt,utd->urd", weights, v.double())[:, :, None]
    step_size = exact.abs().clamp(min=2 ** -8) * 2 ** -8
    return float(((out.double() - exact).abs() / step_size).max())


def main() -> None:
    args = bench_args(__doc__, HERE, rounds=7)
    if not attention._bf16_matmuls_native():
        raise SystemExit("this CPU has no native bf16 arithmetic: bf16 decode steps do not run here")
    keep_freed_host_memory()  # as the engine (engine.py) and the profile do
    load = os.getloadavg()[0]
    g = torch.Generator().manual_seed(0)
    rows = {}
    for name, units, r, d, keys in SHAPES:
        slots = [[torch.randn(keys + 1, units, d, generator=g).to(torch.bfloat16) for _ in range(2)]
                 for _ in range(LAYERS)]
        caches = [(kc[:keys].transpose(0, 1), vc[:keys].transpose(0, 1)) for kc, vc in slots]
        q = torch.randn(units, r, 1, d, generator=g).to(torch.bfloat16)
        valid = torch.ones(units, keys, dtype=torch.bool)
        valid[::4, : keys // 8] = False  # some units' left padding
        run = functools.partial(step, q, caches, valid)
        on_path(False, run), on_path(True, run)  # warm-up
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for fused in (False, True):
                times[fused].append(on_path(fused, run))
        errors = {}
        for fused in (False, True):
            before = attention.set_fused_decode("cpu", 1 if fused else None)
            errors[fused] = error_steps(attention.attend(q, *caches[0], valid, causal=False), q, *caches[0], valid)
            attention.set_fused_decode("cpu", before)
        f32, fused = (statistics.median(times[p]) / LAYERS * 1e3 for p in (False, True))
        pairs = statistics.median(a / b for a, b in zip(times[False], times[True]))
        rows[name] = {"float32_path_ms": round(f32, 3), "fused_ms": round(fused, 3), "ratio": round(pairs, 2),
                      "max_error_bf16_steps": {"float32_path": round(errors[False], 2),
                                               "fused": round(errors[True], 2)}}
        print(f"{name:32s} float32 path {f32:7.3f} ms, fused {fused:7.3f} ms a layer: {pairs:.2f}x; "
              f"largest error {errors[False]:.2f} / {errors[True]:.2f} bf16 steps", file=sys.stderr)
    append_record(args.out, {"rounds": args.rounds, "threads": args.threads, "layers": LAYERS, "shapes": rows}, load,
                  "python runs/bench/decode_attention_paths/bench.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
