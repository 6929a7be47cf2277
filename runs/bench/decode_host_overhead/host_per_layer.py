"""A decode step's host time per layer, on a model so small that its arithmetic is nothing:
what the engine's own work around the kernels costs (loading a layer's weights, the cache's
bookkeeping, attention's small operations, the Python between them). On a GPU this is what a
decode step waits for (runs/gpu/h200-2026-11-28/README.md, section 3: our step ~2-4x FlexGen's
per layer there), so it is measured here, on any machine, and cut here.

    python runs/bench/decode_host_overhead/host_per_layer.py [POLICY ...] [--prof]

A random OPT of 32 layers (hidden 32), 2 prompts of 40 tokens, float32, one thread; per
policy the best of 3 runs of 2 and of 22 new tokens, their difference over the 20 steps.
Policies: "resident" (everything on the compute device), "streamed" (16% of the cache there,
the rest and the activations in RAM, as the search chose on the H200). --prof: where the
host time of one run goes, by function (cProfile).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from conftest import save_tiny  # the tests' random checkpoints

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split

LAYERS, PROMPTS, PROMPT_LEN = 32, 2, 40
POLICIES = {"resident": Policy(gpu_batch_size=PROMPTS),
            "streamed": Policy(gpu_batch_size=PROMPTS, cache=Split(0.16, 0.84, 0), activations=Split(0, 1, 0))}


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(POLICIES)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp())
    path = save_tiny("opt", work / "opt", num_hidden_layers=LAYERS, max_position_embeddings=256)
    prompts = [[5 + (i * 7 + j) % 250 for j in range(PROMPT_LEN)] for i in range(PROMPTS)]
    for name in names:
        engine = Engine.load(str(path), POLICIES[name], dtype="float32", device="cpu", offload_dir=work,
                             progress=False)

        def run(tokens: int, engine=engine) -> float:
            t0 = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
            return time.perf_counter() - t0

        for _ in range(3):
            run(2)
        short, long = min(run(2) for _ in range(3)), min(run(22) for _ in range(3))
        step = (long - short) / 20
        print(f"{name}: a decode step {step * 1e3:.2f} ms, {step / LAYERS * 1e6:.0f} us a layer")
        if "--prof" in sys.argv:
            prof = cProfile.Profile()
            prof.runcall(run, 22)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
