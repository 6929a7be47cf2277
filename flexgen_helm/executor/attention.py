"""Scaled dot-product attention over KV-cache units.

A unit is one (sequence, key-value head) pair: the cache of a GPU batch is split over
the tiers by units, and attention is independent per unit, so each tier's part can be
computed where it lives (CPU delegation) and the parts joined afterwards."""

from __future__ import annotations

import math

import torch


def to_units(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(b, heads, s, d) -> (b * kv_heads, heads_per_kv, s, d)."""
    b, h, s, d = x.shape
    return x.reshape(b * num_kv_heads, h // num_kv_heads, s, d)


def from_units(x: torch.Tensor, batch: int) -> torch.Tensor:
    """(b * kv_heads, heads_per_kv, s, d) -> (b, s, heads * d)."""
    u, r, s, d = x.shape
    return x.reshape(batch, (u // batch) * r, s, d).transpose(1, 2).reshape(batch, s, -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
           causal: bool, keep_fraction: float = 1.0) -> torch.Tensor:
    """q: (u, r, q_len, d); k, v: (u, t, d); key_valid: (u, t) bool. Queries are the last
    q_len positions. Returns (u, r, q_len, d) in q's dtype.

    With keep_fraction < 1 (sparse attention, decode only) each query keeps its top
    ceil(keep_fraction * t) keys by score and the softmax is taken over those alone,
    i.e. the kept weights are renormalised to sum to one."""
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
        keep = max(1, math.ceil(keep_fraction * t))
        if keep < t:
            top = scores.topk(keep, dim=-1)  # (u, r, 1, keep)
            index = top.indices.squeeze(2)[..., None].expand(u, r, keep, d)
            v_kept = torch.gather(v.float()[:, None].expand(u, r, t, d), 2, index)
            return torch.matmul(top.values.softmax(-1), v_kept).to(q.dtype)  # renormalised over kept keys
    probs = scores.softmax(-1)
    return torch.matmul(probs, v.float().unsqueeze(1)).to(q.dtype)
