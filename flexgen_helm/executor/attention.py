"""Scaled dot-product attention over KV-cache units.

A unit is one (sequence, key-value head) pair: the cache of a GPU batch is split over
the tiers by units, and attention is independent per unit, so each tier's part can be
computed where it lives (CPU delegation) and the parts joined afterwards."""

from __future__ import annotations

import math
from typing import Callable

import torch


def to_units(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(b, heads, s, d) -> (b * kv_heads, heads_per_kv, s, d)."""
    b, h, s, d = x.shape
    return x.reshape(b * num_kv_heads, h // num_kv_heads, s, d)


def from_units(x: torch.Tensor, batch: int) -> torch.Tensor:
    """(b * kv_heads, heads_per_kv, s, d) -> (b, s, heads * d)."""
    u, r, s, d = x.shape
    return x.reshape(batch, (u // batch) * r, s, d).transpose(1, 2).reshape(batch, s, -1)


# Sorted key positions -> the values there, (u, n, d): lets sparse attention read only the
# rows of V it keeps (the disk tier); a plain tensor of all of V serves as well.
ValueRows = Callable[[list[int]], torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | ValueRows, key_valid: torch.Tensor,
           causal: bool, keep_fraction: float = 1.0) -> torch.Tensor:
    """q: (u, r, q_len, d); k: (u, t, d); v: (u, t, d) or a ValueRows; key_valid: (u, t)
    bool. Queries are the last q_len positions. Returns (u, r, q_len, d) in q's dtype.

    With keep_fraction < 1 (sparse attention, decode only) each query keeps the top
    ceil(keep_fraction * n) of the n keys it may see (its unit's valid keys: padding does
    not count, so the block shape cannot change n) and the softmax is taken over those
    alone, i.e. the kept weights are renormalised to sum to one; V is asked only for the
    rows some query of some unit keeps.

    Top-k per tier is global top-k: the cache is split over the tiers by units (a sequence's
    key-value head), never by positions, so all keys a query can attend to live on the tier
    attend() is called for, and each query's top-k here is its top-k over the whole cache.
    The schedule may therefore run sparse attention tier by tier, exactly."""
    u, r, q_len, d = q.shape
    t = k.shape[1]
    scores = torch.matmul(q.float(), k.float().transpose(1, 2).unsqueeze(1)) / math.sqrt(d)  # (u, r, q, t)
    allowed = key_valid[:, None, None, :].expand(u, r, q_len, t)
    if causal:
        qpos = torch.arange(t - q_len, t, device=q.device)[:, None]
        kpos = torch.arange(t, device=q.device)[None, :]
        allowed = allowed & (kpos <= qpos)
        # a padding query may see no valid key; let it see itself so that it stays finite
        allowed = allowed | (kpos == qpos)
    scores = scores.masked_fill(~allowed, -math.inf)
    if keep_fraction < 1.0 and q_len == 1:
        return _top_k_attention(scores, v, key_valid, keep_fraction).to(q.dtype)
    if callable(v):
        v = v(list(range(t)))
    probs = scores.softmax(-1)
    return torch.matmul(probs, v.float().unsqueeze(1)).to(q.dtype)


def _top_k_attention(scores: torch.Tensor, v: torch.Tensor | ValueRows, key_valid: torch.Tensor,
                     keep_fraction: float) -> torch.Tensor:
    """Decode attention over each query's top keys; scores: (u, r, 1, t) masked with -inf."""
    u, r, _, t = scores.shape
    # per unit, in Python floats so that every policy rounds the same way
    keeps = [max(1, math.ceil(keep_fraction * n)) for n in key_valid.sum(-1).tolist()]
    top = scores.topk(max(keeps), dim=-1)  # sorted, best first: (u, r, 1, K)
    kept = torch.arange(top.indices.shape[-1], device=scores.device) < torch.tensor(keeps, device=scores.device)[:, None]
    kept = kept[:, None, None, :]  # (u, 1, 1, K): a unit keeping fewer than K drops the tail
    weights = top.values.masked_fill(~kept, -math.inf).softmax(-1)  # renormalised over kept keys
    index = top.indices.squeeze(2)  # (u, r, K) key positions
    if callable(v):
        positions = index[kept.squeeze(2).expand_as(index)].unique()  # sorted
        v = v(positions.tolist())  # (u, n, d): the kept rows only
        index = torch.searchsorted(positions, index).clamp_(max=len(positions) - 1)  # dropped ones: weight 0
    d = v.shape[-1]
    v_kept = torch.gather(v.float()[:, None].expand(u, r, v.shape[1], d), 2, index[..., None].expand(*index.shape, d))
    return torch.matmul(weights, v_kept)
