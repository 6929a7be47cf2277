"""GPTQ (Frantar et al., 2022): quantize a Linear weight against the inputs it will see,
in the same group-wise codes, scales and minimums that min/max RTN writes (quantize.py),
so the stored format and the int4 kernels take its output unchanged.

Given the Hessian H = X^T X / T of the layer's calibration inputs X (T tokens, one row
each), the output error ||(W - Q) X^T|| is lowered by quantizing the input columns of W in
order and pushing each column's rounding error onto the columns not yet quantized,
weighted by the Cholesky factor U of H^-1 (upper: H^-1 = U^T U):

    err = (w_i - q_i) / U[i, i];   w_j -= err * U[i, j]   for every j > i

A group's scale and minimum are its min/max, taken when its first column is reached, i.e.
from the values the error feedback has made of it by then. The updates are applied lazily
(_quantize_run): most of the work is matrix products, few column-sized steps.

Inputs wider than MAX_COLUMN_BLOCK are quantized in independent column blocks of that
width (a block-diagonal H): the error of a column then flows only within its block, so
blocks of one width are quantized side by side, a column of each per step. On
this 2-core CPU the Cholesky and inverse of one 8192 x 8192 H (OPT-1.3B's fc2) take ~40 s
and computing H itself T * 8192^2 multiply-adds; 24 of them alone would miss the 3-minute
conversion goal. Blocks of 2048 keep every input of SmolLM2 (576, 1536) and all of
OPT-1.3B's but fc2 whole; what the blocking costs in error on wide inputs is measured
in tests/test_gptq.py and runs/accuracy.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from flexgen_helm.compression.quantize import QuantizedTensor, pack
from flexgen_helm.policy.policy import Compression

DAMP = 0.01  # added to H's diagonal, relative to its mean: keeps H invertible (GPTQ's default)
LAZY_COLUMNS = 128  # columns whose updates reach the columns after them in one product
INNER_COLUMNS = 16  # columns whose updates reach each other one by one (rank-1 updates)
MAX_COLUMN_BLOCK = 2048  # widest input quantized with a full H (module doc)


def column_blocks(columns: int, group_size: int, group_dim: int,
                  max_block: int = MAX_COLUMN_BLOCK) -> list[tuple[int, int]]:
    """The input-column ranges quantized each with its own H: whole groups when the groups
    run along the columns (dim 1), so a group is never split between two blocks."""
    step = max(group_size, max_block // group_size * group_size) if group_dim == 1 else max_block
    return [(start, min(start + step, columns)) for start in range(0, columns, step)]


def input_hessians(x: torch.Tensor, blocks: list[tuple[int, int]]) -> list[torch.Tensor]:
    """X^T X / T of each column block, for inputs x (..., columns) in float32."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    return [torch.mm(x2[:, a:b].t(), x2[:, a:b]).div_(x2.shape[0]) for a, b in blocks]


def input_factors(x: torch.Tensor, blocks: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The inverse Cholesky factor of each column block's H, for inputs x (..., columns)."""
    return [inverse_cholesky(h) for h in input_hessians(x, blocks)]


def gptq_quantize(w: torch.Tensor, factors: list[torch.Tensor], blocks: list[tuple[int, int]],
                  cfg: Compression, group_dim: int, dtype: torch.dtype) -> QuantizedTensor:
    """GPTQ's codes for an (out, in) weight `w`, given each column block's inverse Cholesky
    factor (input_factors); the scales and minimums are stored in `dtype` (the codes are
    chosen against the stored values, so dequantizing reproduces what the error feedback
    assumed)."""
    out_dim, in_dim = w.shape
    group = cfg.group_size
    if w.dim() != 2 or group_dim not in (0, 1):
        raise ValueError(f"GPTQ quantizes 2-D (out, in) weights with groups along dim 0 or 1, got shape "
                         f"{tuple(w.shape)} and group dim {group_dim}")
    if w.shape[group_dim] % group:
        raise ValueError(f"group size {group} does not divide dim {group_dim} of a {tuple(w.shape)} weight")
    edges = [a for a, _ in blocks] + [blocks[-1][1]] if blocks else []
    tiled = edges[:1] == [0] and edges[-1:] == [in_dim] and all(a < b for a, b in blocks) \
        and all(b == a2 for (_, b), (a2, _) in zip(blocks, blocks[1:]))
    if not tiled or len(factors) != len(blocks) or (group_dim == 1 and any(a % group for a, _ in blocks)):
        raise ValueError(f"column blocks {blocks} (with {len(factors)} factors) do not tile the {in_dim} "
                         f"input columns in whole groups")
    # the columns as rows: each step reads and updates contiguous memory (`to` alone would
    # keep the transpose's strides, and a row would then be a column: ~10x slower steps)
    wt = torch.empty(in_dim, out_dim).copy_(w.t())
    grid = (in_dim // group, out_dim) if group_dim == 1 else (in_dim, out_dim // group)  # a row per column step
    out = _Codes(torch.empty(in_dim, out_dim, dtype=torch.uint8), torch.empty(grid, dtype=dtype),
                 torch.empty(grid, dtype=dtype), (1 << cfg.bits) - 1, group, group_dim)
    done = 0  # blocks quantized so far
    for first, count, width in _equal_runs(blocks):
        u = torch.stack(factors[done:done + count])
        _quantize_run(wt[first:first + count * width].view(count, width, out_dim), u, out, first, count, width)
        done += count
    if group_dim == 1:  # (in, out) -> (out, ng, group): each group's codes last, for packing
        grouped = out.codes.t().unflatten(1, (in_dim // group, group))
    else:  # (in, out) -> (ng, in, group)
        grouped = out.codes.unflatten(1, (out_dim // group, group)).transpose(0, 1)
    return QuantizedTensor(data=pack(grouped, cfg.bits).contiguous(), scale=out.scale.t().contiguous(),
                           min=out.min.t().contiguous(), shape=(out_dim, in_dim), dtype=dtype, bits=cfg.bits,
                           group_size=group, group_dim=group_dim)


def _equal_runs(blocks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first column, count, width) of each run of consecutive blocks of one width: a run's
    blocks are quantized side by side, each column step taking one column of every block."""
    runs: list[tuple[int, int, int]] = []
    for a, b in blocks:
        if runs and runs[-1][2] == b - a:
            first, count, width = runs[-1]
            runs[-1] = (first, count + 1, width)
        else:
            runs.append((a, 1, b - a))
    return runs


@dataclass(frozen=True)
class _Codes:
    """What GPTQ writes, a row per input column (per group of input columns for the scales
    and minimums when the groups run along the input): codes (in, out); scales and
    minimums transposed from their QuantizedTensor shape; and the grouping they follow."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    levels: int
    group_size: int
    group_dim: int

    def run(self, first: int, count: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (count, rows, ...) of the codes, scales and minimums of a run of blocks."""
        per = width // self.group_size if self.group_dim == 1 else width
        start = first // self.group_size if self.group_dim == 1 else first
        return (self.codes[first:first + count * width].view(count, width, -1),
                self.scale[start:start + count * per].view(count, per, -1),
                self.min[start:start + count * per].view(count, per, -1))


def inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """Upper U with U^T U = (H + damping)^-1. With J the reversal of the order, the lower
    Cholesky factor L of J H J gives U = J L^-1 J: one factorization and one triangular
    inverse, where cholesky -> cholesky_inverse -> cholesky costs ~4x more here."""
    h = h.clone()
    diag = h.diagonal()
    dead = diag == 0  # an input that was always zero: its column just rounds
    diag[dead] = 1
    diag.add_(DAMP * diag.mean())
    flipped = h.flip(0, 1)
    chol, info = torch.linalg.cholesky_ex(flipped)
    if info.item():
        raise ValueError(f"the calibration inputs' Hessian ({h.shape[0]} x {h.shape[0]}) is not positive "
                         f"definite even with {DAMP:g} x its mean diagonal added")
    return lower_triangular_inverse(chol).flip(0, 1)


def lower_triangular_inverse(lower: torch.Tensor, leaf: int = 256) -> torch.Tensor:
    """L^-1 by halves, [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]], so most of
    the work is matrix products: 2048 x 2048 in 70 ms here, against 130 ms for a triangular
    solve against the identity (same float32 error, ~1.5e-7 relative)."""
    n = lower.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(lower, torch.eye(n, dtype=lower.dtype), upper=False)
    half = n // 2
    a, c = lower_triangular_inverse(lower[:half, :half], leaf), lower_triangular_inverse(lower[half:, half:], leaf)
    out = torch.zeros_like(lower)
    out[:half, :half], out[half:, half:] = a, c
    out[half:, :half] = (c @ (lower[half:, :half] @ a)).neg_()
    return out


def _quantize_run(wt: torch.Tensor, u: torch.Tensor, out: _Codes, first: int, count: int, width: int) -> None:
    """GPTQ over `count` blocks of `width` columns side by side (in place: wt (count, width,
    out), each block's columns as rows; u (count, width, width), each block's U): the blocks'
    errors stay within their own block, so a column step takes one column of every block.
    The first column is input column `first`, a group boundary.

    Two levels of laziness: a column's update reaches the next few (`inner`) columns at once
    (a rank-1 update each), the rest of its lazy batch after those few (one product), and
    the columns after the batch after the whole batch (one product). A group's min/max is
    taken when its first column is reached, once every earlier column's update is in."""
    group, n = out.group_size, width
    codes, scales, mins = out.run(first, count, width)
    lazy, inner = LAZY_COLUMNS, INNER_COLUMNS
    if out.group_dim == 1:  # a group never straddles two batches: its grid is read whole
        lazy, inner = max(group, LAZY_COLUMNS // group * group), math.gcd(group, INNER_COLUMNS)
    steps = _ColumnSteps(wt, u, codes, scales, mins, out, inner)
    batch_errors = torch.empty(count, min(lazy, n), wt.shape[2])  # one buffer: a fresh one costs page faults
    for a in range(0, n, lazy):
        b = min(a + lazy, n)
        errors = batch_errors[:, :b - a]
        for c in range(a, b, inner):
            d = min(c + inner, b)
            if out.group_dim == 1 and c % group == 0:
                steps.take_grid(c)
            with _one_thread():
                steps.columns(c, d, errors[:, c - a:d - a])
            if d < b:
                wt[:, d:b].baddbmm_(u[:, c:d, d:b].transpose(1, 2), errors[:, c - a:d - a], alpha=-1)
        if b < n:
            wt[:, b:].baddbmm_(u[:, a:b, b:].transpose(1, 2), errors, alpha=-1)


@contextlib.contextmanager
def _one_thread():
    """The column steps are small ops (a few vectors and one (16, out) update each): a second
    thread only adds a barrier per op, and on a shared machine, where it is often descheduled,
    a wait. Measured (2048 x 1024, 2 cores at load ~11): 13-15 s with 2 threads, 1.9 s with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _ColumnSteps:
    """The column-by-column part of a run (_quantize_run): quantize a column of every block,
    keep its error scaled by U's diagonal, push it onto the next few columns."""

    def __init__(self, wt, u, codes, scales, mins, out: _Codes, inner: int):
        self.wt, self.u, self.codes, self.scales, self.mins, self.out = wt, u, codes, scales, mins, out
        self.dinv = u.diagonal(dim1=1, dim2=2).reciprocal().unsqueeze(2)  # (count, width, 1)
        self.q = torch.empty(wt.shape[0], inner, wt.shape[2])  # the codes of the columns in flight, as floats
        self.grid: tuple[torch.Tensor, ...] = ()

    def take_grid(self, c: int) -> None:
        """The grid of the group that starts at column c (groups along the input columns)."""
        g = self.out.group_size
        self.grid = _group_grid(self.wt[:, c:c + g], 1, self.out)
        self.scales[:, c // g], self.mins[:, c // g] = self.grid[:2]

    def columns(self, c: int, d: int, errors: torch.Tensor) -> None:
        """Columns c..d-1 of every block, in order; their scaled errors into `errors`."""
        wt, out = self.wt, self.out
        for i in range(c, d):
            w = wt[:, i]
            if out.group_dim == 0:  # the column's own groups of rows: (count, out / group) each
                grid = _group_grid(w.unflatten(1, (-1, out.group_size)), 2, out)
                self.scales[:, i], self.mins[:, i] = grid[:2]
                self.grid = tuple(t.repeat_interleave(out.group_size, dim=1) for t in grid)
            s, mn, inv = self.grid
            q = torch.sub(w, mn, out=self.q[:, i - c]).mul_(inv).round_().clamp_(0, out.levels)
            # w is done with: it becomes the column's error, scaled by U's diagonal
            e = errors[:, i - c]
            torch.sub(w, torch.addcmul(mn, q, s), out=e).mul_(self.dinv[:, i])
            if i + 1 < d:
                wt[:, i + 1:d].baddbmm_(self.u[:, i, i + 1:d].unsqueeze(2), e.unsqueeze(1), alpha=-1)
        self.codes[:, c:d] = self.q[:, :d - c]


def _group_grid(values: torch.Tensor, axis: int, out: _Codes) -> tuple[torch.Tensor, ...]:
    """(scale, minimum, 1 / scale) of groups running along `axis` of `values`: their min/max,
    as stored, in float32 (1 / scale is 1 for a constant group, whose codes are then 0)."""
    lo = values.amin(axis)
    s = (values.amax(axis) - lo).div_(out.levels).to(out.scale.dtype).float()
    return s, lo.to(out.min.dtype).float(), torch.where(s > 0, s, 1.0).reciprocal_()
