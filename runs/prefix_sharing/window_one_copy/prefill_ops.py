"""The prefill of a block sharing a long prefix, under torch.profiler: SmolLM2, bf16 where the
CPU has bf16 arithmetic, --sequences prompts of --prefix shared tokens and --own of their own
(decode_step.py's), one new token; the ops that took the most of the profiled call, by input
shape.

    python runs/prefix_sharing/window_one_copy/prefill_ops.py [--prefix 1000] [--own 8] [--sequences 32]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared_block import prefix_and_own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--own", type=int, default=8)
    p.add_argument("--sequences", type=int, default=32)
    args = p.parse_args()
    keep_freed_host_memory()
    engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=args.sequences), progress=False)
    prefix, own = prefix_and_own(engine.config.vocab_size, args.prefix, args.own, args.sequences)
    prompts = [prefix + o for o in own]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for _ in range(2):  # warm-up, then one timed
        run = engine.generate(prompts, params)
    print(f"# {machine_label()}: prefill {run.stats.prefill_s:.3f} s (not profiled)")
    with profile(record_shapes=True) as prof:
        engine.generate(prompts, params)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=14,
                                                             max_name_column_width=40, max_shapes_column_width=60))


if __name__ == "__main__":
    main()
