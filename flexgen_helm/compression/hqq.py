"""Fitting a group's scale and minimum to its values instead of taking its min and max
(method "hqq"), for the same affine codes w = min + code * scale that RTN writes.

Min/max round-to-nearest (quantize.py) spends the 2^bits levels on the whole range of a
group, so one outlier stretches every step. Here each group's (scale, min) is fitted by
half-quadratic splitting, the idea of HQQ (Badri & Shaji, 2023): the reconstruction error
is split into a dense part that the grid must fit and a sparse part e (outliers) that it
may give up, and the two are optimized in turn:

1. codes q = clamp(round((x - min) / scale), 0, levels) for the current grid;
2. e = the shrinkage of the residual, in units of the grid's step: residuals below the
   threshold (rounding) shrink to 0, large ones (clipped outliers) are mostly kept;
3. (scale, min) = the least-squares fit of x - e by min + scale * q: a 2x2 linear regression
   per group, in closed form. HQQ itself fits only the zero point and keeps the min/max
   scale; fitting the scale too is what lets a group shrink its range around an outlier.

The shrinkage threshold grows looser each round (beta *= kappa), so late rounds fit the
grid to every value. Data-free: only the weights are read, and the work is a few passes
over them per round (conversion time is in runs/accuracy). The fit starts from min/max,
so a group min/max already fits exactly (e.g. a GGUF block's own grid) keeps it.
"""

from __future__ import annotations

import torch

ROUNDS = 8
# The sparse part's norm is l1 (HQQ's lp with p = 1): its proximal step is a soft threshold,
# two cheap passes. p = 0.7 (HQQ's default) measured the same error (within 0.5%, SmolLM2
# and random weights, 4-bit g64) at twice the time (a pow per element per round).
BETA = 2.0  # initial weight of the split: the threshold is 1 / beta grid steps
KAPPA = 1.2  # growth of beta per round (measured: 1.2 fits better than 1.5, and 1.0 worse)


def _shrink(r: torch.Tensor, beta: float) -> torch.Tensor:
    """Proximal step of |e|: sign(r) * max(|r| - 1 / beta, 0), i.e. r minus r clamped."""
    return r - r.clamp(-1 / beta, 1 / beta)


def fit_scale_min(xg: torch.Tensor, axis: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scale, min) of `xg` (float32/64, groups along `axis`), shapes with `axis`
    removed; scale >= 0, and 0 only for a constant group."""
    n = xg.shape[axis]
    mn = xg.amin(axis, keepdim=True)
    s = (xg.amax(axis, keepdim=True) - mn).div_(levels)
    beta = BETA
    for _ in range(ROUNDS):
        safe = torch.where(s > 0, s, torch.ones_like(s))
        u = (xg - mn).div_(safe)  # position on the grid, in steps
        q = u.round().clamp_(0, levels)
        e = _shrink(u.sub_(q), beta).mul_(safe)  # the outlier part, back in x's units
        t = e.neg_().add_(xg)  # what the grid must fit: x - e
        beta *= KAPPA
        q_mean = q.mean(axis, keepdim=True)
        t_mean = t.mean(axis, keepdim=True)
        cov = torch.linalg.vecdot(q, t, dim=axis).unsqueeze(axis).div_(n).sub_(q_mean * t_mean)
        var = torch.linalg.vecdot(q, q, dim=axis).unsqueeze(axis).div_(n).sub_(q_mean * q_mean)
        fitted = (var > 0) & (cov > 0)  # else (one code used, or a degenerate fit) keep the scale
        s = torch.where(fitted, cov / torch.where(fitted, var, torch.ones_like(var)), s)
        mn = t_mean.sub_(s * q_mean)
    return s.squeeze(axis), mn.squeeze(axis)
