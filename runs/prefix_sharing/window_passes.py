"""A few-shot prefill window's attention past its shared prefix
(attention.attend_window_past_shared_prefix), this checkout's against the attention.py of
another commit, at natural-easy's shapes (SmolLM2: 3 key-value heads of 3 query heads, 64
wide; a GPU batch of 126 prompts of 85 own tokens after a 302-token prefix), bfloat16 on a
CPU with bf16 arithmetic. Checks the outputs' bits are the same, then times six layers'
calls, alternating the two, six rounds; prints the rounds and their medians (ms per layer).

    python runs/prefix_sharing/window_passes.py --base-commit <commit> [--sequences 126]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import flexgen_helm.executor.attention as current
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label

KV_HEADS, QUERY_HEADS, WIDTH, PREFIX, OWN, LAYERS, ROUNDS = 3, 3, 64, 302, 85, 6, 6


def attention_at(commit: str):
    """The attention module as it was at `commit` (its file, imported beside this checkout's)."""
    root = Path(__file__).resolve().parents[2]
    source = subprocess.run(["git", "show", f"{commit}:flexgen_helm/executor/attention.py"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "attention_at_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("attention_at_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-commit", required=True)
    p.add_argument("--sequences", type=int, default=126)
    args = p.parse_args()
    keep_freed_host_memory()
    if not current._bf16_matmuls_native():
        raise SystemExit("this CPU has no native bf16 matmuls: the window's bf16 path this benchmark names "
                         "does not run here (attention.prefix_for_decode takes the float32 layout)")
    base = attention_at(args.base_commit)
    torch.manual_seed(0)
    units = args.sequences * KV_HEADS
    layers = []
    for _ in range(LAYERS):
        q = torch.randn(units, QUERY_HEADS, OWN, WIDTH).bfloat16()
        k, v = (torch.randn(units, OWN, WIDTH) + 0.5).bfloat16(), torch.randn(units, OWN, WIDTH).bfloat16()
        keys, values = torch.randn(KV_HEADS, PREFIX, WIDTH) + 1.0, torch.randn(KV_HEADS, PREFIX, WIDTH)
        layers.append((q, k, v, {m: m.prefix_for_decode(keys, values, "cpu", torch.bfloat16) for m in (current, base)}))
    valid = torch.rand(units, OWN) < 0.97
    for q, k, v, prefix in layers[:1]:
        outs = [m.attend_window_past_shared_prefix(q, k, v, valid, prefix[m]) for m in (current, base)]
        if not torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)):
            raise SystemExit("the two attention.py give different bits")
    times = {"this checkout": [], f"at {args.base_commit}": []}
    for _ in range(ROUNDS):
        for series, module in zip(times.values(), (current, base)):
            start = time.perf_counter()
            for q, k, v, prefix in layers:
                module.attend_window_past_shared_prefix(q, k, v, valid, prefix[module])
            series.append((time.perf_counter() - start) / LAYERS * 1e3)
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}: {args.sequences} prompts x {OWN} own tokens past "
          f"a {PREFIX}-token prefix, ms per layer (the same bits)")
    for name, series in times.items():
        print(f"{name:>20}: {' '.join(f'{x:.1f}' for x in series)}  median {sorted(series)[ROUNDS // 2]:.1f}")


if __name__ == "__main__":
    main()
