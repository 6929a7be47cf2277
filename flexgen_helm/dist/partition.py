"""Splitting the layers into pipeline stages of balanced cost."""

from __future__ import annotations

from flexgen_helm.models.spec import LayerSpec


def layer_costs(layers: list[LayerSpec]) -> list[int]:
    """A layer's cost is its weight count: decode is bound by moving (or reading) weights,
    and prefill FLOPs grow with them too. A tied tensor is counted where it is used."""
    return [sum(t.numel for t in layer.tensors) for layer in layers]


def balanced_bounds(costs: list[int], stages: int) -> list[int]:
    """Stage boundaries b[0]=0 < ... < b[stages]=len(costs) that minimise the largest
    stage cost over contiguous splits (exact, by dynamic programming)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} pipeline stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest possible largest-stage cost for the first i layers in s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]
