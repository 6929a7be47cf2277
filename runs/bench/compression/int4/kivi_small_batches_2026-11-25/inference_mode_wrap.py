"""What inference mode is worth, measured from outside an engine that does not enter it itself
(25571c9 and before): lambada_engine.py's bf16 and 4-bit deployments, each generate run plainly,
under torch.no_grad() and under torch.inference_mode(), alternating after a warm-up; the fastest
of 3 runs each. (The copy engine's worker threads stay outside any mode here: a mode is per thread.)

    git worktree add --detach /work/ab_infmode 25571c9
    PYTHONPATH=/work/ab_infmode python inference_mode_wrap.py
"""

import contextlib
import time
from pathlib import Path

import torch
from lambada_engine import DEPLOYMENTS, lambada_prompts, load_engines

import flexgen_helm
from flexgen_helm.executor.sampling import SamplingParams

MODES = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def main() -> None:
    print("source:", flexgen_helm.__file__)
    engines = load_engines({name: DEPLOYMENTS[name] for name in ("bf16", "4bit")})
    prompts = lambada_prompts(engines["bf16"])
    params = SamplingParams(max_new_tokens=8)
    best: dict[tuple[str, str], float] = {}
    for round_ in range(4):  # round 0 is the warm-up
        for name, engine in engines.items():
            for mode, context in MODES.items():
                with context():
                    t0 = time.perf_counter()
                    engine.generate(prompts, params)
                    wall = time.perf_counter() - t0
                if round_ > 0:
                    best[name, mode] = min(best.get((name, mode), wall), wall)
    print("load average:", Path("/proc/loadavg").read_text().strip())
    for mode in MODES:
        print(f"{mode:15s} bf16 {best['bf16', mode]:.3f} s  4-bit {best['4bit', mode]:.3f} s  "
              f"bf16 / 4-bit {best['bf16', mode] / best['4bit', mode]:.2f}")


if __name__ == "__main__":
    main()
