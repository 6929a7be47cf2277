"""helm-run with every `Engine.generate` call's RunStats timers logged: where a deployment's
prefill and decode go inside a HELM run (the compute, the cache stores, the loads), one JSON
line per call.

    GEN_LOG=<file.jsonl> python runs/compression_8bit/generate_timers/helm_run_timers.py \\
        -r lambada:model=flexgen/smollm2-135m lambada:model=flexgen/smollm2-135m-4bit -m 10 \\
        --suite x -o out -n 2 --runner-class-name flexgen_helm.helm.runner.BatchingRunner

The arguments are helm-run's. Each line: the deployment's weight compression, its policy, the
prompts' count and lengths, the call's wall seconds, prefill and decode seconds, and its timers.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

import flexgen_helm.engine as engine

if "GEN_LOG" not in os.environ:
    sys.exit("set GEN_LOG to the JSON-lines file the calls are logged to")
_generate = engine.Engine.generate


def logged_generate(self, prompts, *args, **kwargs):
    start = time.perf_counter()
    run = _generate(self, prompts, *args, **kwargs)
    stats = run.stats
    with open(os.environ["GEN_LOG"], "a") as f:
        f.write(json.dumps({"weights": str(self.policy.compress_weight), "policy": self.policy.describe(),
                            "prompts": len(prompts), "lengths": [len(p) for p in prompts],
                            "wall_s": time.perf_counter() - start, "prefill_s": stats.prefill_s,
                            "decode_s": stats.decode_s,
                            "timers": {k: round(v, 4) for k, v in stats.timers.items()}}) + "\n")
    return run


engine.Engine.generate = logged_generate
sys.argv = ["helm-run", *sys.argv[1:]]
runpy.run_module("helm.benchmark.run", run_name="__main__")
