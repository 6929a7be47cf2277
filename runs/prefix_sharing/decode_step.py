"""What a shared prompt prefix costs a decode step, and what sharing saves a prefill.

    python runs/prefix_sharing/decode_step.py [--model smollm2-135m] [--prefix 1000] [--sequences 32]

The machine's saved profile is applied first (use_profile), as every command that loads an
engine does: the kernels it chose (e.g. the shared prefix's part on torch's fused kernel) are
the record's. One block of `--sequences` prompts: `--prefix` tokens they all start with, then 8 of their
own. Three runs of one engine (sharing on), after a warm-up, in turns: the block with its
shared prefix, the block without any prefix (the 8 tokens alone), and the block with the
prefix computed whole (sharing off). Per run: prefill seconds and the mean decode step
(decode seconds / steps). Appends one JSON line to results.jsonl beside this file, with the
host and the load average.

The issue's decode goal: a step with the shared prefix at most 1.3x a step with no prefix.
With sharing the block holds the prefix's KV once, and a decode step attends to it as one
matmul per key-value head for every sequence's queries (attention.attend_past_shared_prefix);
without sharing each sequence holds and reads its own copy. `--skip-unshared` leaves out the
third run (a float32 OPT-1.3B prefill of 32 x 1,000 tokens takes minutes on a 2-core CPU).
`--other-decode-path` adds a run of the shared prefix with its decode steps on the path the
profile did not choose (attention.FUSED_PREFIX_PART's "decode": torch's fused kernel or our
products), in the same rounds, so that both paths' ratios come from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from flexgen_helm.engine import Engine
from flexgen_helm.executor import attention
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.hardware_profile import use_profile
from flexgen_helm.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_block import prefix_and_own

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dummy", action="store_true", help="random weights (OPT sizes)")
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-unshared", action="store_true", help="no run with sharing off")
    p.add_argument("--other-decode-path", action="store_true",
                   help="also the shared prefix with decode steps on the path the profile did not choose")
    p.add_argument("--label", default="", help="what the record measured (e.g. the commit)")
    args = p.parse_args()
    profile = use_profile()  # what this machine's profile chose, as every command that loads an engine applies it
    policy = Policy(gpu_batch_size=args.sequences, num_gpu_batches=1)
    engine = Engine.load(args.model, policy, dummy=args.dummy, progress=False)
    prefix, own = prefix_and_own(engine.config.vocab_size, args.prefix, 8, args.sequences)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    chosen = attention.FUSED_PREFIX_PART["cpu"]
    other = chosen ^ {"decode"}
    other_name = "shared prefix, decode on " + ("the fused kernel" if "decode" in other else "our products")
    cases = {"shared prefix": ([prefix + o for o in own], True, chosen), "no prefix": (own, True, chosen),
             other_name: ([prefix + o for o in own], True, other),
             "prefix, sharing off": ([prefix + o for o in own], False, chosen)}
    if args.skip_unshared:
        del cases["prefix, sharing off"]
    if not args.other_decode_path:
        del cases[other_name]
    engine.generate(own, params)  # warm-up
    rows = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (prompts, sharing, uses) in cases.items():
            engine.policy = dataclasses.replace(policy, prefix_sharing=sharing)
            attention.set_fused_prefix_part("cpu", uses)
            t0 = time.perf_counter()
            stats = engine.generate(prompts, params).stats
            rows[name].append({"prefill_s": stats.prefill_s, "decode_step_s": stats.decode_s / (args.new_tokens - 1),
                               "wall_s": time.perf_counter() - t0,
                               "computed_prompt_tokens": stats.computed_prompt_tokens})
    best = {name: min(r, key=lambda x: x["decode_step_s"]) for name, r in rows.items()}
    record = {"label": args.label, "host": machine_label(), "dtype": str(engine.runtime.devices.dtype),
              "model": args.model,
              "prefix": args.prefix, "sequences": args.sequences, "new_tokens": args.new_tokens,
              "loadavg_1m": os.getloadavg()[0], "runs": rows, "best": best,
              "profile": None if profile is None else profile.measured_at,
              "fused_prefix_part": sorted(chosen),
              "fused_decode_from_keys": attention.FUSED_DECODE["cpu"],
              "decode_step_ratio_shared_vs_no_prefix": best["shared prefix"]["decode_step_s"]
              / best["no prefix"]["decode_step_s"],
              **({f"decode_step_ratio {other_name} vs no prefix": best[other_name]["decode_step_s"]
                  / best["no prefix"]["decode_step_s"]} if other_name in best else {}),
              "prefill_speedup_sharing": None if args.skip_unshared else
              best["prefix, sharing off"]["prefill_s"] / best["shared prefix"]["prefill_s"],
              "command": "python runs/prefix_sharing/decode_step.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if not isinstance(v, bool))
              + "".join(f" --{k.replace('_', '-')}" for k, v in vars(args).items() if v is True)}
    with (HERE / "results.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    for name, r in best.items():
        print(f"{name:>20}: prefill {r['prefill_s']:.2f} s, decode step {1000 * r['decode_step_s']:.1f} ms")
    print(f"decode step, shared prefix / no prefix: {record['decode_step_ratio_shared_vs_no_prefix']:.2f}x")
    if record["prefill_speedup_sharing"] is not None:
        print(f"prefill, sharing off / on: {record['prefill_speedup_sharing']:.2f}x")


if __name__ == "__main__":
    main()
