"""Each prefill expert call of an OLMoE-1B-7B bench (cut to LAYERS blocks) timed in the engine,
then right after it the same three products on bf16 weights made up front, twice, on the same
rows: what the engine's call costs beside bare products in the same moment, and whether a
product runs slower as the first after the engine's call than when repeated. Minor page faults
of each (getrusage), and the hand-backs of freed memory (schedule.hand_back_freed_memory).

    LAYERS=4 python runs/bench/moe_decode_step/expert_first_call.py bench --model allenai/olmoe-1b-7b-0924 \\
        --dummy --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 2 --gpu-mem 1.5GiB --cpu-mem 4GiB \\
        --policy <policy.json> --warmup 0 --quiet

(THP_MEM_ALLOC_ENABLE=1 in the environment: torch's own switch for huge pages under its
allocations of 2 MB and more.) Output: expert_first_call_2026-11-29.txt.
"""

from __future__ import annotations

import atexit
import os
import resource
import runpy
import sys
import time

import torch

import flexgen_helm.executor.schedule as schedule
from flexgen_helm.models import moe
from flexgen_helm.models.gated_mlp import gated_mlp

moe.GEOMETRIES["allenai/olmoe-1b-7b-0924"]["num_hidden_layers"] = int(os.environ.get("LAYERS", "4"))
totals = {key: [0.0, 0] for key in ("engine", "first_after", "second_after")}
rows = [0]
bare_weights: list = []
hand_backs = [0, 0.0]
_expert = moe._expert
_hand_back = schedule.hand_back_freed_memory


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(key: str, fn):
    f0, t0 = faults(), time.perf_counter()
    out = fn()
    totals[key][0] += time.perf_counter() - t0
    totals[key][1] += faults() - f0
    return out


def expert(cfg, w, e, x):
    if x.shape[0] < 256:  # a decode step's few rows: untouched
        return _expert(cfg, w, e, x)
    if not bare_weights:
        shapes = [(cfg.expert_ffn_size, cfg.hidden_size)] * 2 + [(cfg.hidden_size, cfg.expert_ffn_size)]
        bare_weights.extend(torch.randn(s).to(x.dtype) for s in shapes)
    out = timed("engine", lambda: _expert(cfg, w, e, x))
    timed("first_after", lambda: gated_mlp(x, *bare_weights, cfg.mlp_activation))
    timed("second_after", lambda: gated_mlp(x, *bare_weights, cfg.mlp_activation))
    rows[0] += x.shape[0]
    return out


def hand_back():
    t0 = time.perf_counter()
    done = _hand_back()
    hand_backs[0] += 1
    hand_backs[1] += time.perf_counter() - t0
    return done


def report() -> None:
    print(f"hand-backs {hand_backs[0]} ({hand_backs[1]:.2f} s); minor faults in all {faults()}", file=sys.stderr)
    flop = rows[0] * 6 * 2048 * 1024  # OLMoE's expert: three 2048 x 1024 products
    for key, (seconds, n) in totals.items():
        print(f"{key:14s} {seconds:7.3f} s {n:9d} minor faults {flop / seconds / 1e9:6.0f} GFLOP/s-equivalent",
              file=sys.stderr)


moe._expert = expert
schedule.hand_back_freed_memory = hand_back
atexit.register(report)
sys.argv = ["flexgen-helm"] + sys.argv[1:]
runpy.run_module("flexgen_helm", run_name="__main__")
