"""How prompts of different lengths are cut into GPU batches (each padded to its own longest):
the fewest within the padding tolerance, then the least padding."""

from __future__ import annotations

import itertools
import random

from flexgen_helm.executor.generation import plan_blocks
from flexgen_helm.executor.length_buckets import cut_by_length
from flexgen_helm.policy import Policy


def _padding(run: list[int]) -> int:
    return len(run) * max(run) - sum(run)


def test_cuts_are_the_fewest_runs_within_the_tolerance_then_the_least_padding():
    """Against every cut of the sorted lengths into consecutive runs."""
    rng = random.Random(0)
    for _ in range(200):
        lengths = sorted(rng.randint(20, 40) for _ in range(rng.randint(1, 9)))
        max_size, tol = rng.randint(1, 5), rng.choice([0.02, 0.05, 0.1])
        best = None
        for cuts in itertools.product([False, True], repeat=len(lengths) - 1):
            runs, cur = [], [lengths[0]]
            for cut, n in zip(cuts, lengths[1:]):
                if cut:
                    runs.append(cur)
                    cur = []
                cur.append(n)
            runs.append(cur)
            if all(len(r) <= max_size and (len(r) == 1 or _padding(r) <= tol * sum(r)) for r in runs):
                score = (len(runs), sum(map(_padding, runs)))
                best = score if best is None or score < best else best
        got = [lengths[a:b] for a, b in cut_by_length(lengths, max_size, tol)]
        assert [n for run in got for n in run] == lengths
        assert all(len(r) <= max_size and _padding(r) <= tol * sum(r) for r in got)
        assert (len(got), sum(map(_padding, got))) == best, (lengths, max_size, tol)


def test_blocks_hold_gpu_batches_of_similar_length_longest_first():
    lengths = [103, 5, 300, 100, 6, 280, 102, 7, 101, 310]
    blocks = plan_blocks(lengths, Policy(gpu_batch_size=4, num_gpu_batches=2))
    assert [[[lengths[i] for i in batch] for batch in block] for block in blocks] == [
        [[310, 300], [280], [103, 102, 101, 100], [7]], [[6], [5]]]  # at most 4 x 2 sequences a block


def test_mixed_lengths_make_as_many_blocks_as_the_block_size_allows():
    """Cutting GPU batches by padding never adds a block: each block but the last is full
    (a block more is another pass over the weights at every decode step)."""
    rng = random.Random(1)
    for _ in range(50):
        lengths = [int(10 * 300 ** rng.random()) for _ in range(rng.randint(1, 200))]
        policy = Policy(gpu_batch_size=rng.choice([1, 4, 8, 16]), num_gpu_batches=rng.choice([1, 2, 3]))
        blocks = plan_blocks(lengths, policy)
        sizes = [sum(map(len, block)) for block in blocks]
        assert sizes[:-1] == [policy.block_size] * (len(blocks) - 1) and 0 < sizes[-1] <= policy.block_size
        assert sorted(i for block in blocks for batch in block for i in batch) == list(range(len(lengths)))
        assert all(len(batch) <= policy.gpu_batch_size for block in blocks for batch in block)


def test_prompts_of_one_length_fill_the_policys_block():
    """A benchmark's equal prompts run in the policy's block shape, in their order."""
    blocks = plan_blocks([64] * 20, Policy(gpu_batch_size=4, num_gpu_batches=2))
    assert blocks == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]], [[16, 17, 18, 19]]]
