"""Cutting prompts sorted by length into runs of similar length: the engine's GPU batches
(each padded to its own longest prompt) and the HELM client's batches both come from here."""

from __future__ import annotations

import itertools

# A GPU batch's padding may add at most this fraction to its real prompt tokens: >= 1 / 1.04 =
# 96% of the prompt tokens computed are real, which leaves room for the output tokens computed
# past a stop sequence (counted as padding too) within the 95% of issue 24's goal.
PAD_TOLERANCE = 0.04


def cut_by_length(lengths: list[int], max_size: int, pad_tolerance: float | None = PAD_TOLERANCE,
                  max_tokens: int | None = None, shared_prefix: int = 0) -> list[tuple[int, int]]:
    """The fewest runs [start, end) of `lengths` (sorted, shortest first) of at most `max_size`
    each, whose padding to their longest adds at most `pad_tolerance` x their real tokens (None:
    no bound) and whose padded tokens stay within `max_tokens` (None: no bound; a longer one
    runs alone; the `shared_prefix` tokens every sequence starts with count once, as a run
    computes and holds them once); of those cuts, the one with the least padding, and of those, the one whose
    runs end furthest to the long end (equal lengths: full runs there, a part-filled one
    holding the shortest).

    A shortest path over the cut points, `max_size` candidate starts per end."""
    real_before = list(itertools.accumulate(lengths, initial=0))  # real tokens of lengths[:i]
    best: list[tuple[int, int]] = [(0, 0)]  # best[i]: (runs, padding) of the best cut of lengths[:i]
    start_of: list[int] = [0]  # start_of[i]: where the last run of that cut starts
    for end in range(1, len(lengths) + 1):
        longest = lengths[end - 1]
        best.append((len(lengths) + 1, 0))
        start_of.append(end - 1)
        for start in range(end - 1, max(0, end - max_size) - 1, -1):
            size = end - start
            real = real_before[end] - real_before[start]
            padding = size * longest - real
            # a shorter length added in front only raises the padding and its ratio to the real
            # tokens (the mean length falls), so the first start that fails ends the search
            if size > 1 and ((pad_tolerance is not None and padding > pad_tolerance * real)
                             or (max_tokens is not None
                                 and size * (longest - shared_prefix) + shared_prefix > max_tokens)):
                break
            candidate = (best[start][0] + 1, best[start][1] + padding)
            if candidate <= best[end]:  # of equal cuts, the one whose runs are full at the long end
                best[end], start_of[end] = candidate, start
    runs = []
    end = len(lengths)
    while end:
        runs.append((start_of[end], end))
        end = start_of[end]
    return runs[::-1]
