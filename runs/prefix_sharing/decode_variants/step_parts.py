"""Where a decode step's extra time beside a shared prefix goes, in the engine as it runs:
SmolLM2 (bf16 on a CPU with bf16 arithmetic), a block of 32 prompts that share a 1,000-token
prefix and have 8 tokens of their own, 16 new tokens. Four runs of one engine, in turns, after
a warm-up, `--rounds` times:

- as it runs: attention.attend_past_shared_prefix;
- prefix part reused: the same, but each layer's prefix part (_bf16_prefix_part, its two
  products, exponentials and sums) computed once and reused at later steps: what is left is
  the stacking of the queries, the own keys' part and the merge;
- own keys only: attend() over each sequence's own keys, the prefix not attended to at all:
  what is left is what the block's bookkeeping of the prefix costs outside attention;
- no prefix: the 8 tokens alone (the issue's denominator).

The second and third compute wrong tokens (the steps still run the same shapes: the lengths
are fixed). Prints the fastest mean decode step of each (ms) and the differences.

    python runs/prefix_sharing/decode_variants/step_parts.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import flexgen_helm.executor.attention as attention
import flexgen_helm.executor.schedule as schedule
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared_block import prefix_and_own

NEW_TOKENS = 16
AS_IT_RUNS = attention.attend_past_shared_prefix
COMPUTED_PART = attention._bf16_prefix_part


REUSED: list[dict] = []  # each prefix_part_reused's parts, to check the variant ran what it names


def prefix_part_reused():
    parts = {}
    REUSED.append(parts)

    def part(q, prefix):
        key = (tuple(q.shape), id(prefix))
        if key not in parts:
            parts[key] = COMPUTED_PART(q, prefix)
        return parts[key]
    return part


def own_keys_only(q, k, v, own, prefix, first_unit=0, softcap=0.0, sinks=None):
    return attention.attend(q, k, v, own, causal=False, softcap=softcap, sinks=sinks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=32, num_gpu_batches=1), progress=False)
    prefix, own = prefix_and_own(engine.config.vocab_size, 1000, 8, 32)
    shared = [prefix + o for o in own]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine.generate(shared, params)  # warm-up
    variants = {"as it runs": (shared, AS_IT_RUNS, None), "prefix part reused": (shared, AS_IT_RUNS, True),
                "own keys only": (shared, own_keys_only, None), "no prefix": (own, AS_IT_RUNS, None)}
    steps = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (prompts, attend_fn, reuse) in variants.items():
            schedule.attend_past_shared_prefix = attend_fn
            attention._bf16_prefix_part = prefix_part_reused() if reuse else COMPUTED_PART
            steps[name].append(engine.generate(prompts, params).stats.decode_s / (NEW_TOKENS - 1) * 1e3)
    schedule.attend_past_shared_prefix, attention._bf16_prefix_part = AS_IT_RUNS, COMPUTED_PART
    if not any(REUSED):
        raise SystemExit("the prefix part was never computed in bf16 (attention._bf16_prefix_part): this host or "
                         "dtype takes the float32 layout, so 'prefix part reused' would time the step as it runs")
    best = {name: min(s) for name, s in steps.items()}
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}: mean decode step (ms), fastest of {args.rounds}")
    for name, s in steps.items():
        print(f"{name:>20}: {best[name]:5.1f}  ({' '.join(f'{x:.1f}' for x in s)})")
    print(f"the prefix part's math: {best['as it runs'] - best['prefix part reused']:.1f} ms; stacking, own part "
          f"and merge beyond plain attention: {best['prefix part reused'] - best['own keys only']:.1f} ms; "
          f"outside attention: {best['own keys only'] - best['no prefix']:.1f} ms; "
          f"ratio {best['as it runs'] / best['no prefix']:.3f}")


if __name__ == "__main__":
    main()
