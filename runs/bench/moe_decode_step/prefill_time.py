"""A `flexgen-helm` command with each prefill's wall time and the page faults it took printed
(stderr): OLMoE-1B-7B's geometry cut to LAYERS blocks (default 4), as time_parts.py.

    LAYERS=4 python runs/bench/moe_decode_step/prefill_time.py bench --model olmoe-1b-7b --dummy \\
        --dtype bfloat16 --device cpu --prompt-len 512 --gen-len 4 \\
        --policy runs/compare/olmoe-1b-7b-p512-g32/2026-11-28_dequant_addcmul/ours-4bit.policy.json --warmup 0
"""

from __future__ import annotations

import os
import resource
import sys
import time

import flexgen_helm.executor.schedule as schedule
from flexgen_helm.cli import main
from flexgen_helm.models import moe

moe.GEOMETRIES["allenai/olmoe-1b-7b-0924"]["num_hidden_layers"] = int(os.environ.get("LAYERS", "4"))
_prefill = schedule.BlockSchedule.prefill


def timed_prefill(self, *args, **kwargs):
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = _prefill(self, *args, **kwargs)
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(f"prefill {time.perf_counter() - start:.2f} s, minor faults {after.ru_minflt - before.ru_minflt}, "
          f"major {after.ru_majflt - before.ru_majflt}", file=sys.stderr)
    return out


schedule.BlockSchedule.prefill = timed_prefill
sys.exit(main(sys.argv[1:]))
