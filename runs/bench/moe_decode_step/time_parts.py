"""Where an MoE decode step's expert time goes, in the engine as it runs: `flexgen-helm bench`
with timing wrappers round the experts' call (models/moe.expert_mlp, decode calls only: at
most 64 rows), torch's int4 kernel inside it (compression/int4._kernel_mm), and each expert's
load and release (executor/expert_weights.ExpertsOnDemand). OLMoE-1B-7B's geometry with
LAYERS blocks (default 4; its dummy weights take minutes to place at 16).

    LAYERS=4 python runs/bench/moe_decode_step/time_parts.py bench --model olmoe-1b-7b --dummy \\
        --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 32 \\
        --policy runs/compare/olmoe-1b-7b-p512-g32/2026-11-28_dequant_addcmul/ours-4bit.policy.json \\
        --warmup 0 --quiet

Prints one line (stderr): per decode call of the experts, its mean time and the int4 kernel's
share, and the mean time of an expert's load and release.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import time

import flexgen_helm.compression.int4 as int4
import flexgen_helm.executor.expert_weights as expert_weights
from flexgen_helm.models import moe

DECODE_ROWS = 64

moe.GEOMETRIES["allenai/olmoe-1b-7b-0924"]["num_hidden_layers"] = int(os.environ.get("LAYERS", "4"))
totals = {"experts": [0.0, 0], "kernel_in_experts": [0.0, 0], "load": [0.0, 0], "release": [0.0, 0]}
kernel_seconds = [0.0]


def _timed(key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[key][0] += time.perf_counter() - start
        totals[key][1] += 1
        return out
    return wrapper


def _kernel(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        kernel_seconds[0] += time.perf_counter() - start
        return out
    return wrapper


def _experts(fn):
    def wrapper(cfg, w, x):
        start, kernel_before = time.perf_counter(), kernel_seconds[0]
        out = fn(cfg, w, x)
        if x.numel() // x.shape[-1] <= DECODE_ROWS:
            totals["experts"][0] += time.perf_counter() - start
            totals["experts"][1] += 1
            totals["kernel_in_experts"][0] += kernel_seconds[0] - kernel_before
        return out
    return wrapper


def _report() -> None:
    calls = max(totals["experts"][1], 1)
    parts = [f"decode expert calls {totals['experts'][1]}: {totals['experts'][0] / calls * 1e3:.2f} ms each, "
             f"of which the int4 kernel {totals['kernel_in_experts'][0] / calls * 1e3:.2f} ms"]
    for key in ("load", "release"):
        seconds, n = totals[key]
        parts.append(f"expert {key} {seconds / max(n, 1) * 1e6:.1f} us ({n} calls)")
    print("; ".join(parts), file=sys.stderr)


int4._kernel_mm = _kernel(int4._kernel_mm)
moe.expert_mlp = _experts(moe.expert_mlp)
expert_weights.ExpertsOnDemand._load = _timed("load", expert_weights.ExpertsOnDemand._load)
expert_weights.ExpertsOnDemand.release = _timed("release", expert_weights.ExpertsOnDemand.release)
atexit.register(_report)
sys.argv = ["flexgen_helm", *sys.argv[1:]]
runpy.run_module("flexgen_helm", run_name="__main__")
