"""The block the prefix-sharing benchmarks run: `sequences` prompts that start with the same
`prefix` random tokens, each followed by `own` random tokens of its own (seeded, so every
script and checkout draws the same ones)."""

from __future__ import annotations

import random


def prefix_and_own(vocab: int, prefix: int, own: int, sequences: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix's tokens and each sequence's own."""
    rng = random.Random(0)
    shared = [rng.randrange(10, vocab) for _ in range(prefix)]
    return shared, [[rng.randrange(10, vocab) for _ in range(own)] for _ in range(sequences)]
