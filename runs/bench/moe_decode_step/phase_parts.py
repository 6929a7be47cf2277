"""Where an MoE bench's prefill and decode time goes, part by part, in the engine as it runs:
`flexgen-helm bench` with timing wrappers (perf_counter; the torch profiler inflates large
products) round a block's q/k/v (models/moe.qkv: the norm, projections, q/k norms, rotary),
its attention (schedule.attend), its output projection with the residual, the MLP call
(models/moe.mlp_output), the experts' call inside it (expert_mlp) and each expert's products
(_expert), the router, the dense copies of compressed weights (CompressedWeight.dense) and the
int4 kernel. OLMoE-1B-7B's geometry cut to LAYERS blocks (default 4; 16 is the whole model).

    LAYERS=16 python runs/bench/moe_decode_step/phase_parts.py bench --model allenai/olmoe-1b-7b-0924 --dummy \\
        --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 32 --gpu-mem 1.5GiB --cpu-mem 4GiB \\
        --policy runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_gathered_decode/ours-4bit.policy.json --warmup 0 --quiet

Prints (stderr) per phase and part: seconds, calls and the rows multiplied (experts: their
gathered rows; the kernel: its activation rows).
"""

from __future__ import annotations

import atexit
import collections
import os
import runpy
import sys
import time

import flexgen_helm.compression.int4 as int4
import flexgen_helm.executor.schedule as schedule
from flexgen_helm.models import moe

moe.GEOMETRIES["allenai/olmoe-1b-7b-0924"]["num_hidden_layers"] = int(os.environ.get("LAYERS", "4"))
totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0])
phase = ["prefill"]


def timed(owner, name: str, part: str, rows_of=None) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        t = totals[f"{phase[0]}.{part}"]
        t[0] += time.perf_counter() - start
        t[1] += 1
        t[2] += rows_of(args) if rows_of else 0
        return out
    setattr(owner, name, wrapper)


_prefill = schedule.BlockSchedule.prefill


def prefill(self, *args, **kwargs):
    phase[0] = "prefill"
    start = time.perf_counter()
    out = _prefill(self, *args, **kwargs)
    totals["prefill.total"][0] += time.perf_counter() - start
    totals["prefill.total"][1] += 1
    phase[0] = "decode"
    return out


def report() -> None:
    for key, (seconds, calls, rows) in sorted(totals.items()):
        print(f"{key:28s} {seconds:8.3f} s {calls:7d} calls {rows:9d} rows", file=sys.stderr)


schedule.BlockSchedule.prefill = prefill
timed(moe, "qkv", "qkv")
timed(schedule, "attend", "attend")
timed(moe, "attention_output", "o_proj and residual")
timed(moe, "mlp_output", "mlp_output")
timed(moe, "expert_mlp", "expert_mlp")
timed(moe, "route", "route")
timed(moe, "_expert", "experts' products", rows_of=lambda a: a[3].shape[0])
timed(int4.CompressedWeight, "dense", "dense copies")
timed(int4, "_kernel_mm", "int4 kernel", rows_of=lambda a: a[0].shape[0])
atexit.register(report)
sys.argv = ["flexgen-helm"] + sys.argv[1:]
runpy.run_module("flexgen_helm", run_name="__main__")
