"""Where a few-shot block's prefill goes, in the engine as it runs: SmolLM2 (bf16 on a CPU with
bf16 arithmetic), one GPU batch of --sequences prompts that share a --prefix-token prefix and
have --own tokens each (natural-easy's shapes by default: its calls run 51-126 prompts of 73-104
own tokens past 302 shared, helm_shares/), one new token. Timing wrappers (time.perf_counter:
a CPU computes synchronously) round the model's linears, the transformer block's two halves
(llama.qkv: norm, projections, rotary; llama.finish_block: output projection, norm, MLP), the
attention of the window past the prefix and its two parts. Prints, for each of --rounds runs
after a warm-up, the prefill's seconds and each part's.

    python runs/prefix_sharing/prefill_parts.py [--sequences 126] [--prefix 302] [--own 85] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import flexgen_helm.executor.attention as attention
import flexgen_helm.executor.shared_prefix as shared_prefix
import flexgen_helm.models.gated_mlp as gated_mlp
import flexgen_helm.models.llama as llama
from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_block import prefix_and_own

seconds: dict[str, float] = collections.defaultdict(float)
LABELS: list[str] = []  # in the order printed


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)
    if label not in LABELS:
        LABELS.append(label)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds[label] += time.perf_counter() - start
        return out

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=126)
    p.add_argument("--prefix", type=int, default=302)
    p.add_argument("--own", type=int, default=85)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    timed(llama, "linear", "linears (all)")
    timed(gated_mlp, "linear", "linears (all)")
    timed(llama, "qkv", "qkv: norm, q/k/v projections, rotary")
    timed(llama, "finish_block", "finish_block: output projection, norm, MLP")
    timed(shared_prefix.PrefixLayer, "attend_window", "attention of the window past the prefix")
    timed(attention, "_window_prefix_part", "  its prefix part")
    timed(attention, "_own_window_bf16", "  its own part (bf16)")
    timed(attention, "_own_keys_and_prefix", "  its own part (float32)")
    engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=args.sequences, num_gpu_batches=1), progress=False)
    prefix, own = prefix_and_own(engine.config.vocab_size, args.prefix, args.own, args.sequences)
    prompts = [prefix + o for o in own]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    print(f"# {machine_label()}: {args.sequences} prompts x {args.own} own tokens past a {args.prefix}-token prefix, "
          f"seconds")
    for _ in range(args.rounds):
        seconds.clear()
        stats = engine.generate(prompts, params).stats
        print(f"prefill {stats.prefill_s:.3f} (load {os.getloadavg()[0]:.2f})")
        for label in LABELS:
            print(f"  {label}: {seconds[label]:.3f}")


if __name__ == "__main__":
    main()
