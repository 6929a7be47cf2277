"""What a shared prefix adds to a decode step, op by op: SmolLM2 (bf16 where the CPU has bf16
arithmetic), a block of --sequences prompts, with a --prefix-token shared prefix and 8 tokens
of their own, and with the 8 tokens alone. Each is run with 17 and with 2 new tokens under
torch.profiler, and the difference over 15 steps is one step's ops: self CPU time (us) with
the prefix, without it, and the difference, largest first.

    python runs/prefix_sharing/decode_step_ops.py [--prefix 1000] [--sequences 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch.profiler import profile

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_block import prefix_and_own

LONG, SHORT = 17, 2


def op_times(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    with profile() as prof:
        engine.generate(prompts, params)
    return {e.key: e.self_cpu_time_total for e in prof.key_averages()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--sequences", type=int, default=32)
    args = p.parse_args()
    keep_freed_host_memory()
    engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=args.sequences), progress=False)
    prefix, own = prefix_and_own(engine.config.vocab_size, args.prefix, 8, args.sequences)
    per_step = {}
    for name, prompts in (("shared", [prefix + o for o in own]), ("none", own)):
        long, short = op_times(engine, prompts, LONG), op_times(engine, prompts, SHORT)
        per_step[name] = {k: (long[k] - short.get(k, 0.0)) / (LONG - SHORT) for k in long}
    keys = set(per_step["shared"]) | set(per_step["none"])
    diff = {k: per_step["shared"].get(k, 0.0) - per_step["none"].get(k, 0.0) for k in keys}
    print(f"# {machine_label()}: one decode step's ops, us (self CPU, under the profiler)")
    print("| op | shared prefix | no prefix | difference |\n|---|---:|---:|---:|")
    for k in sorted(keys, key=lambda k: -diff[k])[:20]:
        print(f"| {k} | {per_step['shared'].get(k, 0.0):.0f} | {per_step['none'].get(k, 0.0):.0f} | {diff[k]:.0f} |")
    print(f"| all | {sum(per_step['shared'].values()):.0f} | {sum(per_step['none'].values()):.0f} | "
          f"{sum(diff.values()):.0f} |")


if __name__ == "__main__":
    main()
