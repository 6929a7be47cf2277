"""A decode step's attention calls in an MoE bench, as the engine runs them: `flexgen-helm
bench` with timing wrappers round attention.attend (decode calls: one query) and
BlockSchedule._decode_attention, and the shapes of the calls. OLMoE-1B-7B's geometry with
LAYERS blocks (default 4).

    LAYERS=4 python runs/bench/moe_decode_step/attention_calls.py bench --model olmoe-1b-7b --dummy \\
        --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 32 \\
        --policy runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_gathered_decode/ours-4bit.policy.json \\
        --warmup 0 --quiet

Prints (stderr) each timer's seconds, calls and ms a call, and the five commonest call shapes
(queries, keys, dtype, strides, whether attend reads the cache a piece of positions at a time).
"""

from __future__ import annotations

import atexit
import collections
import os
import runpy
import sys
import time

import flexgen_helm.executor.attention as attention
import flexgen_helm.executor.schedule as schedule
from flexgen_helm.models import moe

moe.GEOMETRIES["allenai/olmoe-1b-7b-0924"]["num_hidden_layers"] = int(os.environ.get("LAYERS", "4"))
totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
shapes: collections.Counter = collections.Counter()
_attend = attention.attend
_decode_attention = schedule.BlockSchedule._decode_attention


def attend(q, k, v, key_valid, causal, *args, **kwargs):
    start = time.perf_counter()
    out = _attend(q, k, v, key_valid, causal, *args, **kwargs)
    if q.shape[2] == 1:
        totals["attend"][0] += time.perf_counter() - start
        totals["attend"][1] += 1
        pieced = None if callable(v) else attention._by_positions(k, v)
        shapes[(tuple(q.shape), tuple(k.shape), str(k.dtype), k.stride(), pieced)] += 1
    return out


def decode_attention(self, *args, **kwargs):
    start = time.perf_counter()
    out = _decode_attention(self, *args, **kwargs)
    totals["_decode_attention"][0] += time.perf_counter() - start
    totals["_decode_attention"][1] += 1
    return out


def report() -> None:
    for name, (seconds, calls) in totals.items():
        per_call = seconds / max(calls, 1) * 1e3
        print(f"{name}: {seconds:.3f} s over {calls} calls, {per_call:.2f} ms/call", file=sys.stderr)
    for shape, n in shapes.most_common(5):
        print(n, shape, file=sys.stderr)


schedule.attend = attend
schedule.BlockSchedule._decode_attention = decode_attention
atexit.register(report)
sys.argv = ["flexgen-helm"] + sys.argv[1:]
runpy.run_module("flexgen_helm", run_name="__main__")
