"""A `flexgen-helm` command with its first prefill under torch.profiler: the ops that took the
most of it (self CPU time, calls), printed at exit (stderr). LAYERS=N cuts OLMoE-1B-7B's
geometry to N blocks (its dummy weights take minutes to place at 16); SHAPES=1 groups the ops
by input shape; ROWS=N prints the N busiest (default 30).

    LAYERS=4 python runs/bench/op_profile/first_prefill_ops.py bench --model olmoe-1b-7b --dummy \\
        --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 2 \\
        --policy runs/compare/olmoe-1b-7b-p512-g32/2026-11-28_dequant_addcmul/ours-4bit.policy.json \\
        --warmup 0 --quiet
"""

from __future__ import annotations

import atexit
import os
import sys

from torch.profiler import profile

import flexgen_helm.executor.schedule as schedule
from flexgen_helm.cli import main
from flexgen_helm.models import moe

if "LAYERS" in os.environ:
    moe.GEOMETRIES["allenai/olmoe-1b-7b-0924"]["num_hidden_layers"] = int(os.environ["LAYERS"])
SHAPES = bool(os.environ.get("SHAPES"))
profiler = profile(record_shapes=SHAPES)
_prefill = schedule.BlockSchedule.prefill
calls = [0]


def profiled_prefill(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] != 1:
        return _prefill(self, *args, **kwargs)
    profiler.start()
    try:
        return _prefill(self, *args, **kwargs)
    finally:
        profiler.stop()


def report() -> None:
    if not calls[0]:
        print("no prefill ran: nothing profiled", file=sys.stderr)
        return
    events = profiler.key_averages(group_by_input_shape=SHAPES)
    rows = sorted(((e.key + (f" {e.input_shapes}"[:90] if SHAPES else ""), e.self_cpu_time_total / 1e6, e.count)
                   for e in events), key=lambda row: -row[1])
    print(f"first prefill, self CPU time of all ops: {sum(r[1] for r in rows):.2f} s", file=sys.stderr)
    for name, seconds, count in rows[:int(os.environ.get("ROWS", 30))]:
        print(f"{name:100s} {seconds:8.3f} s {count:7d}", file=sys.stderr)


schedule.BlockSchedule.prefill = profiled_prefill
atexit.register(report)
sys.exit(main(sys.argv[1:]))
