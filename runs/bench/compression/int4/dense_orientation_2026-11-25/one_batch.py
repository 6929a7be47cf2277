"""The README main job's WikiText at the engine (wikitext_engine.py's 10 paragraphs), as two score
batches of 5 (the main job's two HELM batches, from batching.MIN_CAPPED_BATCH = 8) and as one of
10, BF16 and 4-bit, alternating, 4 rounds; prints every wall time and the ratios of the fastest.

    PYTHONPATH=<checkout> python one_batch.py
"""

import time
from pathlib import Path

from wikitext_engine import DEPLOYMENTS, load_engines, paragraphs


def run(engine, prompts, split: bool) -> float:
    t0 = time.perf_counter()
    for part in (prompts[:5], prompts[5:]) if split else (prompts,):
        engine.score(part, top_logprobs=1)
    return time.perf_counter() - t0


def main(rounds: int = 4) -> None:
    engines = load_engines(DEPLOYMENTS)
    prompts = paragraphs(engines["bf16"])
    for engine in engines.values():
        run(engine, prompts, True)  # warm-up
    walls: dict[tuple[str, bool], list[float]] = {}
    for _ in range(rounds):
        for split in (True, False):
            for name, engine in engines.items():
                walls.setdefault((name, split), []).append(run(engine, prompts, split))
    for (name, split), times in walls.items():
        print(name, "two batches" if split else "one batch", " ".join(f"{t:.2f}" for t in times),
              f"fastest {min(times):.3f} s")
    for split in (True, False):
        ratio = min(walls["bf16", split]) / min(walls["4bit", split])
        print(f"4-bit / BF16 token/s, {'two batches' if split else 'one batch'}: {ratio:.2f}")
    print("load average:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
