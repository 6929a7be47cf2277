"""The README main job's WikiText (paragraphs) at the engine: 10 paragraphs of the test set scored in
two batches of 5 (as the main job's two HELM batches), BF16 against the 4-bit deployment, each
deployment's policy as helm-run loads it, alternating after a warm-up; prints each run's wall time
and the ratio of the fastest runs.

    PYTHONPATH=<checkout> python wikitext_engine.py [rounds]
"""

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kivi_small_batches_2026-11-25"))
from lambada_engine import load_engines

WIKITEXT = Path(__file__).resolve().parents[5] / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
W4 = {"bits": 4, "group_size": 64}
DEPLOYMENTS = {"bf16": None, "4bit": {"compress_weight": W4, "compress_cache": {**W4, "cache_grouping": "kivi"}}}


def paragraphs(engine) -> list[list[int]]:
    lines = [s.strip() for s in WIKITEXT.read_text().split("\n")]
    lines = [s for s in lines if len(s) > 200 and not s.startswith("=")]  # paragraphs, not headings
    return [engine.tokenizer(t)["input_ids"][:256] for t in random.Random(0).sample(lines, 10)]


def run(engine, prompts, batches: int = 2) -> float:
    """Wall time of scoring `prompts` in `batches` equal score calls (the main job's two HELM
    batches by default)."""
    size = -(-len(prompts) // batches)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), size):
        engine.score(prompts[start:start + size], top_logprobs=1)
    return time.perf_counter() - t0


def main(rounds: int) -> None:
    engines = load_engines(DEPLOYMENTS)
    prompts = paragraphs(engines["bf16"])
    print("tokens:", sum(map(len, prompts)))
    for e in engines.values():
        run(e, prompts)
    walls = {n: [] for n in engines}
    for r in range(rounds):
        for name, e in engines.items():
            walls[name].append(run(e, prompts))
            print(f"round {r} {name} {walls[name][-1]:.3f} s", flush=True)
    print("load average:", Path("/proc/loadavg").read_text().strip())
    print("bf16 / 4bit, fastest of each:", f"{min(walls['bf16']) / min(walls['4bit']):.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
