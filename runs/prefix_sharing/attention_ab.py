"""A decode step's attention past a shared prefix, this checkout's against another's, in one run.

    python runs/prefix_sharing/attention_ab.py --base /path/to/other/checkout

attend_past_shared_prefix of both checkouts on the same random inputs (float32, or with
`--dtype bfloat16` the engine's bf16 queries and cache, and the prefix in its bf16 decode
layout where the CPU has bf16 arithmetic): 32 sequences sharing a 1,000-token prefix, 24 own
positions each, at SmolLM2-135M's heads (3 key-value heads x 3 queries, 30 layers) and
OPT-1.3B's (32 x 1, 24 layers), the per-layer call repeated for every layer as a step makes
it. After a warm-up, 7 alternating rounds; the median step time of each, and the largest
difference of their outputs. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch

from flexgen_helm.executor import attention as this
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label


def load_other(checkout: str):
    path = Path(checkout) / "flexgen_helm" / "executor" / "attention.py"
    spec = importlib.util.spec_from_file_location("other_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_times(modules: dict, dtype: torch.dtype, kv_heads: int, per_kv: int, layers: int, sequences: int = 32,
               prefix: int = 1000, d: int = 64, own: int = 24) -> dict:
    g = torch.Generator().manual_seed(0)
    units = sequences * kv_heads
    q, k, v = (torch.randn(units, *shape, generator=g).to(dtype) for shape in ((per_kv, 1, d), (own, d), (own, d)))
    valid = torch.ones(units, own, dtype=torch.bool)
    keys, values = (torch.randn(kv_heads, prefix, d, generator=g).to(dtype) for _ in range(2))
    steps = {}
    for name, m in modules.items():
        kept = m.prefix_for_decode(keys, values, torch.device("cpu"), dtype)
        steps[name] = lambda m=m, kept=kept: [
            m.attend_past_shared_prefix(q, k, v, valid, kept) for _ in range(layers)][0]
    outputs = [step() for step in steps.values()]
    times = {name: [] for name in steps}
    for r in range(7):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return {"median_step_ms": {n: round(1e3 * statistics.median(t), 1) for n, t in times.items()},
            "max_abs_difference": float((outputs[0].float() - outputs[1].float()).abs().max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other checkout (its flexgen_helm/executor/attention.py)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    keep_freed_host_memory()  # as the engine runs: freed memory kept for the next step's tensors
    modules = {"base": load_other(args.base), "this": this}
    load = os.getloadavg()[0]
    record = {"host": machine_label(), "threads": torch.get_num_threads(), "dtype": args.dtype,
              "loadavg_1m_before": load, "smollm2_135m": step_times(modules, dtype, 3, 3, 30),
              "opt_1_3b": step_times(modules, dtype, 32, 1, 24), "loadavg_1m_after": os.getloadavg()[0],
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": f"python runs/prefix_sharing/attention_ab.py --base {args.base} --dtype {args.dtype}"}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
