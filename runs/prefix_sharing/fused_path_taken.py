"""Which path the engine's decode steps past a shared prefix take under this machine's saved
profile (attention.FUSED_PREFIX_PART): a SmolLM2 block of 8 prompts sharing a 200-token prefix,
3 new tokens, counting the calls of the fused decode call (attention._fused_past_prefix) and of
our products' prefix part (attention._bf16_prefix_part, which the prefill windows call too), and
printing the first decode call's inputs (dtypes, the cache view's strides).

    python runs/prefix_sharing/fused_path_taken.py
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from flexgen_helm.engine import Engine
from flexgen_helm.executor import attention, schedule
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.planner.hardware_profile import use_profile
from flexgen_helm.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_block import prefix_and_own


def main() -> None:
    profile = use_profile()
    print(f"# {machine_label()}; profile {None if profile is None else profile.measured_at}; "
          f"fused uses {sorted(attention.FUSED_PREFIX_PART['cpu'])}")
    calls = Counter()

    def counted(name, real):
        def run(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return run

    for name in ("_fused_past_prefix", "_bf16_prefix_part"):
        setattr(attention, name, counted(name, getattr(attention, name)))
    real_call = schedule.attend_past_shared_prefix

    def first_call_shown(q, k, v, own, prefix, *args, **kwargs):
        if not calls["decode calls"]:
            print(f"first decode call: q {q.dtype} {tuple(q.shape)}, k {k.dtype} {tuple(k.shape)} strides "
                  f"{k.stride()}, prefix keys by position {prefix.by_position}")
        calls["decode calls"] += 1
        return real_call(q, k, v, own, prefix, *args, **kwargs)

    schedule.attend_past_shared_prefix = first_call_shown
    engine = Engine.load("smollm2-135m", Policy(gpu_batch_size=8, num_gpu_batches=1), progress=False)
    prefix, own = prefix_and_own(engine.config.vocab_size, 200, 8, 8)
    engine.generate([prefix + o for o in own], SamplingParams(max_new_tokens=3, ignore_eos=True))
    print(f"{engine.config.num_layers} layers, 2 decode steps: " + ", ".join(f"{k} {v}" for k, v in calls.items()))


if __name__ == "__main__":
    main()
