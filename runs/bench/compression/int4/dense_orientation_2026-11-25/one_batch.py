"""The README main job's WikiText at the engine (wikitext_engine.py's 10 paragraphs), as two score
batches of 5 (the main job's two HELM batches before b29bc00 raised MIN_CAPPED_BATCH) and as one of
10, BF16 and 4-bit, alternating, 4 rounds; prints every wall time and the ratios of the fastest.

    PYTHONPATH=<checkout> python one_batch.py
"""

from pathlib import Path

from wikitext_engine import DEPLOYMENTS, load_engines, paragraphs, run


def main(rounds: int = 4) -> None:
    engines = load_engines(DEPLOYMENTS)
    prompts = paragraphs(engines["bf16"])
    for engine in engines.values():
        run(engine, prompts)  # warm-up
    walls: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for batches in (2, 1):
            for name, engine in engines.items():
                walls.setdefault((name, batches), []).append(run(engine, prompts, batches))
    for (name, batches), times in walls.items():
        print(name, f"{batches} batch(es)", " ".join(f"{t:.2f}" for t in times), f"fastest {min(times):.3f} s")
    for batches in (2, 1):
        ratio = min(walls["bf16", batches]) / min(walls["4bit", batches])
        print(f"4-bit / BF16 token/s, {batches} batch(es): {ratio:.2f}")
    print("load average:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
