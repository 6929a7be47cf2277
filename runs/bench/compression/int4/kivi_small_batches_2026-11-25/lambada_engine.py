"""The README main job's LAMBADA at the engine: 10 random passages (seed 0), 8 new tokens, in the
deployments' policies as helm-run loads them (helm/model_deployments.yaml: the planner's block),
BF16 against 4-bit weights + 4-bit KIVI cache and 4-bit weights alone, alternating after a warm-up.
Prints each run's wall time and the per-phase timers of each deployment's fastest run.

    PYTHONPATH=<checkout> python lambada_engine.py [rounds]
"""

import json
import random
import sys
import time
from pathlib import Path

import flexgen_helm
from flexgen_helm.data.lambada import split_last_word
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.helm.engines import get_engine, resolve_load_args

LAMBADA = Path(__file__).resolve().parents[5] / ".." / "shared" / "data" / "lambada" / "lambada_openai_test.jsonl"
W4 = {"bits": 4, "group_size": 64}
DEPLOYMENTS = {
    "bf16": None,
    "4bit": {"compress_weight": W4, "compress_cache": {**W4, "cache_grouping": "kivi"}},
    "w4only": {"compress_weight": W4},
}


def load_engines(deployments: dict) -> dict:
    """Each deployment's engine, as helm-run loads it (the planner's block for its policy)."""
    return {name: get_engine(resolve_load_args("smollm2-135m", policy=p)).engine for name, p in deployments.items()}


def lambada_prompts(engine) -> list[list[int]]:
    """10 LAMBADA passages (seed 0) without their last word, as token ids."""
    texts = [json.loads(line)["text"] for line in LAMBADA.open()]
    return [engine.tokenizer(split_last_word(t)[0])["input_ids"] for t in random.Random(0).sample(texts, 10)]


def main(rounds: int) -> None:
    print("source:", flexgen_helm.__file__)
    engines = load_engines(DEPLOYMENTS)
    prompts = lambada_prompts(engines["bf16"])
    params = SamplingParams(max_new_tokens=8)
    for engine in engines.values():
        engine.generate(prompts, params)  # warm-up
    best: dict[str, tuple[float, dict]] = {}
    for r in range(rounds):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            run = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            print(f"round {r} {name} {wall:.3f} s")
            if name not in best or wall < best[name][0]:
                best[name] = (wall, run.stats.timers)
    print("load average:", Path("/proc/loadavg").read_text().strip())
    print("fastest run per deployment (s):")
    print("timer".ljust(24), *(n.rjust(8) for n in best))
    print("wall".ljust(24), *(f"{w:8.3f}" for w, _ in best.values()))
    for timer in sorted(set().union(*(t for _, t in best.values()))):
        values = [t.get(timer, 0.0) for _, t in best.values()]
        if max(values) >= 0.005:
            print(timer.ljust(24), *(f"{v:8.3f}" for v in values))
    print(f"bf16 / 4bit time (the actual token/s ratio): {best['bf16'][0] / best['4bit'][0]:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
