"""Scaled dot-product attention over KV-cache units.

A unit is one (sequence, key-value head) pair: the cache of a GPU batch is split over
the tiers by units, and attention is independent per unit, so each tier's part can be
computed where it lives (CPU delegation) and the parts joined afterwards."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexgen_helm.errors import PolicyError
from flexgen_helm.memory.devices import cpu_has_bf16_arithmetic
from flexgen_helm.models import cache_pieces

LOG2_E = math.log2(math.e)


def to_units(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(b, heads, s, d) -> (b * kv_heads, heads_per_kv, s, d)."""
    b, h, s, d = x.shape
    return x.reshape(b * num_kv_heads, h // num_kv_heads, s, d)


def unit_sinks(sinks: torch.Tensor | None, num_kv_heads: int, first_unit: int, count: int) -> torch.Tensor | None:
    """A block's attention sinks (num_heads,) (gpt-oss; None: none) as the units first_unit ..
    first_unit + count read them: (count, heads_per_kv) float32, unit u's row the sinks of its
    key-value head's query heads (units are (sequence, kv head) pairs, kv heads fastest)."""
    if sinks is None:
        return None
    per_head = sinks.float().view(num_kv_heads, -1)
    return per_head[torch.arange(first_unit, first_unit + count, device=sinks.device) % num_kv_heads]


def check_sparse_attention(keep_fraction: float, cfg) -> None:
    """Top-k sparse attention renormalises over the keys it keeps, where an attention sink's
    share is of all of them: not computed for sink models, refused before any work."""
    if keep_fraction < 1.0 and cfg.attention_sinks:
        raise PolicyError(f"attn_sparsity {keep_fraction:g}: {cfg.name} has attention sinks (gpt-oss), which top-k "
                          "sparse attention does not compute; run it with dense attention (attn_sparsity 1)")


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax of scores (u, r, ...) over the last dim; with sinks (u, r) (gpt-oss), each
    row's sink logit joins the denominator as a key that adds no value (as transformers' eager
    attention: the sink column appended, the softmax taken, the column dropped)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.to(scores.device, scores.dtype).view(*sinks.shape, *([1] * (scores.dim() - sinks.dim())))
    return torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], -1).softmax(-1)[..., :-1]


def from_units(x: torch.Tensor, batch: int) -> torch.Tensor:
    """(b * kv_heads, heads_per_kv, s, d) -> (b, s, heads * d)."""
    u, r, s, d = x.shape
    return x.reshape(batch, (u // batch) * r, s, d).transpose(1, 2).reshape(batch, s, -1)


# Sorted key positions -> the values there, (u, n, d): lets sparse attention read only the
# rows of V it keeps (the disk tier); a plain tensor of all of V serves as well.
ValueRows = Callable[[list[int]], torch.Tensor]


def decode_cache_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a decode step's attention on `device` reads a loaded cache in: float32 on
    the CPU, whose decode attention computes in float32 (attend()), so a cache dequantized
    or copied for it is never rounded to the compute dtype and converted back; else the
    compute dtype."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | ValueRows, key_valid: torch.Tensor,
           causal: bool, keep_fraction: float = 1.0, window: int = 0, softcap: float = 0.0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: (u, r, q_len, d); k: (u, t, d); v: (u, t, d) or a ValueRows; key_valid: (u, t)
    bool. Queries are the last q_len positions. Returns (u, r, q_len, d) in q's dtype.

    window > 0 (causal attention, a sliding-window block): a query sees only the keys of
    its last `window` positions, itself included (decode callers pass only those keys).
    softcap > 0 (Gemma 2): scores become softcap * tanh(scores / softcap) before the softmax.
    sinks (u, r) (gpt-oss, unit_sinks): each query head's sink logit joins its softmax's
    denominator; the fused kernel gives no log-sum-exp to apply it with, so such attention
    takes the explicit path (float32 scores, chunked), as soft-capped attention does.

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
    if sinks is not None and keep_fraction < 1.0:
        raise ValueError("sparse attention does not compute attention sinks (check_sparse_attention)")
    # (a one-query prefill of a sliding-window block, after a shared prefix, still needs its window's mask)
    if q_len == 1 and (keep_fraction < 1.0 or q.device.type == "cpu") and not (window and t > window):
        # A decode step on CPU: float32 matmuls over the unit's keys, the r query heads of a
        # unit as the rows of one product, exact to float32. torch's fused kernel rounds the
        # weights to the input dtype, and its speed is the machine's: on one 2-core CPU it spent
        # most of a decode step on one query a head (SmolLM2, 96 units x 200 keys: 2.6-2.8x
        # slower than this, 1 thread), on another it took 0.55-0.8x this path's time past 200
        # keys but lost at 24 (a 2-core Xeon with AMX: runs/bench/decode_attention_paths); a
        # bf16 step takes it where `flexgen-helm profile` measured it faster (fused_decode).
        # (bmm, not a broadcast matmul: that would copy the keys once per query head.)
        # A sliding-window block's decode keys are its window already (the caller's).
        v = v(list(range(t))) if callable(v) and keep_fraction == 1.0 else v
        if fused_decode(q, k, keep_fraction, softcap, sinks):
            return _dense_attention(q, k, v, key_valid, causal=False)
        if keep_fraction == 1.0 and _by_positions(k, v):
            return _decode_by_positions(q, k, v, key_valid, softcap, sinks)
        scores = _capped(torch.bmm(q.float().view(u, r, d), k.float().transpose(1, 2)) / math.sqrt(d), softcap)
        scores = scores.masked_fill_(~key_valid[:, None, :], -math.inf).view(u, r, 1, t)  # (u, r, 1, t)
        if keep_fraction < 1.0:
            return _top_k_attention(scores, v, key_valid, keep_fraction).to(q.dtype)
        return torch.bmm(_softmax(scores.view(u, r, t), sinks), v.float()).view(u, r, 1, d).to(q.dtype)
    if callable(v):
        v = v(list(range(t)))
    if softcap or sinks is not None:
        return _explicit_attention(q, k, v, key_valid, causal, window, softcap, sinks)
    return _dense_attention(q, k, v, key_valid, causal, window)


# Device type -> the fewest keys from which a bfloat16 decode step takes torch's fused kernel
# (_dense_attention) instead of attend()'s float32 products (None: never): where `flexgen-helm
# profile` timed it faster on this machine, from that cache length on (planner/hardware_profile
# .use_profile; DeviceSpeeds.attn_decode_fused_gains). Its time per step is near fixed at a few
# dozen keys, where the float32 products' is not: runs/bench/decode_attention_paths.
FUSED_DECODE: dict[str, int | None] = {"cpu": None}


def set_fused_decode(device_type: str, from_keys: int | None) -> int | None:
    """The fewest keys from which bfloat16 decode steps on `device_type` take the fused kernel
    from now on (None: none do); returns the setting before."""
    if device_type not in FUSED_DECODE:
        raise ValueError(f"the decode path is chosen on {', '.join(FUSED_DECODE)}, not {device_type!r}")
    if from_keys is not None and from_keys < 1:
        raise ValueError(f"a decode step's keys are at least 1, got {from_keys}")
    before, FUSED_DECODE[device_type] = FUSED_DECODE[device_type], from_keys
    return before


def fused_decode(q: torch.Tensor, k: torch.Tensor, keep_fraction: float = 1.0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> bool:
    """Whether attend() takes a decode step of queries q over keys k (u, t, d) on the fused
    kernel: bfloat16 queries over a bfloat16 cache read in place (a cache unpacked to float32,
    a loaded or compressed one's, keeps the float32 path rather than being rounded back), as
    many keys as the device's FUSED_DECODE or more (padding columns count: which path a bf16
    step takes, and so its last bits, can follow a GPU batch's padding), dense attention
    without a softcap or sinks (which the kernel cannot compute). torch's CPU kernel computes
    the scores and the softmax in float32 and multiplies the values by the weights rounded to bfloat16,
    as the prompt's bf16 attention (_causal_rows) and the shared prefix's part
    (attend_past_shared_prefix) do: an output's error is then up to ~2^-9 of the values'
    scale, not of its own (its small components lose relative precision; the float32 path
    rounds only the output). float32 steps keep the exact path, so that float32 runs give the
    same tokens under every placement."""
    most = FUSED_DECODE.get(q.device.type)
    return (most is not None and k.shape[1] >= most and q.dtype == k.dtype == torch.bfloat16
            and keep_fraction == 1.0 and not softcap and sinks is None)


def _by_positions(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a CPU decode step reads its keys and values (u, t, d) a piece of positions at a
    time (_decode_by_positions): a 16-bit cache in the KV cache's own position-major layout
    (kv_cache.py: a view of (t, units, d), so a piece of positions is a few contiguous ranges),
    too large for the core's cache (cache_pieces)."""
    def position_major(x: torch.Tensor) -> bool:  # each position's units side by side
        u, _, d = x.shape
        return x.stride(2) == 1 and x.stride(0) == d and x.stride(1) >= u * d

    return (k.dtype != torch.float32 and k.device.type == "cpu" and cache_pieces.pieced(k.numel(), "cpu")
            and position_major(k) and position_major(v))


def _decode_by_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                         softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """attend()'s CPU decode step over a large 16-bit cache (_by_positions), in float32 as the
    whole step, its keys, then its values, a piece of positions (PIECE_ELEMENTS elements) at a
    time: each piece's float32 copy is made and read while in the core's cache, where the
    whole cache's copy streams out to memory and back. The output sums the pieces' products with the
    values, so its last bits depend on the pieces (that is, on the units a call holds).
    OLMoE's 512 units (a batch of 32) x 200 keys, eight layers' caches in turn on the 2-core
    EPYC: 7.4 ms a layer whole, 3.0 in pieces (runs/bench/decode_by_positions); but where
    other machines crowd the host's shared last-level cache the pieces spill too, and it is
    6.7 against 7.4 (its README)."""
    u, r, _, d = q.shape
    t = k.shape[1]
    positions = max(1, cache_pieces.PIECE_ELEMENTS // (u * d))
    qf = q.float().view(u, r, d)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # (t, u, d): the cache's layout
    scores = torch.empty(u, r, t, device=q.device)
    for a in range(0, t, positions):
        scores[:, :, a:a + positions] = torch.bmm(qf, kt[a:a + positions].float().permute(1, 2, 0))
    scores = _capped(scores.div_(math.sqrt(d)), softcap).masked_fill_(~key_valid[:, None, :], -math.inf)
    weights = _softmax(scores, sinks)
    out = torch.bmm(weights[:, :, :positions], vt[:positions].float().transpose(0, 1))
    for a in range(positions, t, positions):
        out.add_(torch.bmm(weights[:, :, a:a + positions], vt[a:a + positions].float().transpose(0, 1)))
    return out.view(u, r, 1, d).to(q.dtype)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def _allowed(key_valid: torch.Tensor, qpos: torch.Tensor, causal: bool, window: int) -> torch.Tensor:
    """(u, c, t) bool: which keys each query at positions qpos (c,) may see. A padding query
    that may see no valid key sees itself, so that it stays finite."""
    kpos = torch.arange(key_valid.shape[1], device=key_valid.device)[None, :]
    qpos = qpos[:, None]
    allowed = key_valid[:, None, :].expand(-1, len(qpos), -1)
    if causal:
        allowed = allowed & (kpos <= qpos)
        if window:
            allowed = allowed & (kpos > qpos - window)
        allowed = allowed | (kpos == qpos)
    return allowed


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                        causal: bool, window: int, softcap: float, sinks: torch.Tensor | None = None,
                        chunk: int = 128) -> torch.Tensor:
    """Attention with soft-capped scores, or sinks, which the fused kernel cannot compute: scores in
    float32, `chunk` queries at a time so that no (q_len, t) matrix of a long prompt exists
    whole."""
    u, r, q_len, d = q.shape
    t = k.shape[1]
    kf, vf = k.float().transpose(1, 2)[:, None], v.float()[:, None]  # (u, 1, d, t), (u, 1, t, d)
    out = torch.empty(u, r, q_len, d, dtype=torch.float32, device=q.device)
    for c0 in range(0, q_len, chunk):
        c1 = min(c0 + chunk, q_len)
        scores = _capped(torch.matmul(q[:, :, c0:c1].float(), kf) / math.sqrt(d), softcap)  # (u, r, c, t)
        qpos = torch.arange(t - q_len + c0, t - q_len + c1, device=q.device)
        scores = scores.masked_fill(~_allowed(key_valid, qpos, causal, window)[:, None], -math.inf)
        out[:, :, c0:c1] = torch.matmul(_softmax(scores, sinks), vf)
    return out.to(q.dtype)


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                     causal: bool, window: int = 0) -> torch.Tensor:
    """Fused attention (torch's scaled_dot_product_attention: no (q, t) score matrix in
    memory, and with is_causal the blocks above the diagonal are skipped). Queries are the
    last q_len positions; a padding query that may see no valid key sees itself, so that
    it stays finite.

    Measured against torch's flex_attention (causal block mask, eager and compiled) and
    blocked attention written with plain ops at SmolLM2's shapes, 512-8192 tokens, on the
    2-core EPYC (flexgen_helm/tools/compare/attention_kernels.py): SDPA was the fastest
    exact one; in bfloat16 on the CPU, causal prompts take _causal_rows instead."""
    u, r, q_len, d = q.shape
    t = k.shape[1]
    dtype = _attention_dtype(q)
    q_, k_, v_ = q.to(dtype), k.to(dtype)[:, None], v.to(dtype)[:, None]
    # a GPU's decode step takes the masked kernel without asking whether anything is masked:
    # the answer (a device-to-host read) would wait for the GPU to finish all it was given,
    # at every layer of every GPU batch
    asks = q_len > 1 or q.device.type != "cuda"
    if asks and bool(key_valid.all()) and (not causal or q_len == t):
        # no padding: the plain (top-left aligned) causal flag is exact when q_len == t
        return _sdpa(q_, k_, v_, causal and q_len > 1, window).to(q.dtype)
    kpos = torch.arange(t, device=q.device)[None, :]
    if causal and q_len == t:
        lengths = key_valid.sum(-1)
        if bool((key_valid == (kpos >= t - lengths[:, None])).all()):  # left padding
            return _left_padded_causal(q_, k_, v_, lengths, window).to(q.dtype)
    allowed = _allowed(key_valid, torch.arange(t - q_len, t, device=q.device), causal, window)
    # the r query heads of a unit share its keys: fold them into the query axis
    mask = allowed[:, None].expand(u, r, q_len, t).reshape(u, 1, r * q_len, t)
    out = _fused(q_.reshape(u, 1, r * q_len, d), k_, v_, attn_mask=mask)
    return out.reshape(u, r, q_len, d).to(q.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int = 0,
          lengths: torch.Tensor | None = None) -> torch.Tensor:
    """q (u, r, s, d); k, v (u, 1, t, d), shared by a unit's r query heads, queries the last
    s positions. Expanded views, not enable_gqa: on CPU that measured slower (0.8-0.9x at
    SmolLM2's 9/3 heads). A sliding window narrower than t is one (s, t) mask shared by
    every unit (the causal flag cannot say it). Causal bf16 prompts on a CPU with bf16
    arithmetic: _causal_rows (lengths: each unit's real keys, its first rows; default all)."""
    u, r, s, d = q.shape
    t = k.shape[2]
    if (causal and s == t and (not window or t <= window) and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and _bf16_matmuls_native()):
        return _causal_rows(q, k[:, 0], v[:, 0], lengths)
    k, v = k.expand(u, r, t, d), v.expand(u, r, t, d)
    if causal and window and t > window:
        qpos = torch.arange(t - s, t, device=q.device)[:, None]
        kpos = torch.arange(t, device=q.device)[None, :]
        near = (kpos <= qpos) & (kpos > qpos - window)
        return _fused(q, k, v, attn_mask=near)
    return _fused(q, k, v, is_causal=causal)


# cuDNN's kernel is left out on a GPU: torch picks it first on an H100/H200, and there each call
# took 2.6 ms of the host's time for 30 us of the GPU's (OPT-6.7B, 16 sequences, a decode step:
# 166 of its 256 ms; runs/gpu/h200-2026-11-29/README.md). Why so much was not pinned down (cuDNN
# builds a graph for each shape it meets, and a decode step's key length is new at every step).
_GPU_SDPA_CHOICES = ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
                     (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
                     (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled))


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """torch's scaled_dot_product_attention; on a GPU, of the kernels the process allows, all but
    cuDNN's (above), unless cuDNN's is the only one allowed."""
    if q.is_cuda:
        allowed = [backend for backend, enabled in _GPU_SDPA_CHOICES if enabled()]
        if allowed:
            with sdpa_kernel(allowed):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# _causal_rows: queries a block, and the scores a call holds (16 MiB in bf16, twice over with
# the softmax's output; a call takes one unit at least, whatever its length)
CAUSAL_ROWS_BLOCK = 128
CAUSAL_ROWS_MAX_SCORES = 1 << 23


@lru_cache(maxsize=1)
def _bf16_matmuls_native() -> bool:
    # where torch emulates bf16 (no AVX512-BF16/AMX) its matmuls are ~10x slower: not measured there
    return cpu_has_bf16_arithmetic()


def _causal_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prompt attention in bfloat16 on the CPU, q (u, r, t, d), k and v (u, t, d), as
    two bf16 matmuls a block of CAUSAL_ROWS_BLOCK queries: a unit's r query heads stacked as
    the rows of one product against the keys up to the block's end (the masked half beyond
    it is never computed), a -inf tile on the diagonal, softmax. Against torch's fused CPU
    kernel at SmolLM2's heads, alone on the 2-core EPYC: 7.3 ms a layer against 12.7 at 1025
    tokens, 114 against 156 at 4096, 353 against 543 at 8192
    (runs/helm_vs_hf/attention_2026-11-25/kernels.txt).

    The scores leave the matmul rounded to bf16 (torch's CPU matmuls write their inputs'
    dtype; the fused kernel keeps them in float32). To keep that rounding small, the mean of
    each unit's real keys (its first lengths[u] rows; default all) is taken out first:
    q . mean is the same for every key of a query, so the softmax, and the output, are
    unchanged by it, while the scores shrink by the component all keys share (large in
    trained models). The 1/sqrt(d) scale goes into the keys with it, before their one
    rounding to bf16.

    A call takes the units a few at a time: their scores within CAUSAL_ROWS_MAX_SCORES and
    their keys' float32 copy within a cache piece (cache_pieces.PIECE_ELEMENTS), so that its
    working copies are a few MiB, not ~100 MB for all units at once (32 x 128 OLMoE positions).
    There, in the engine, a call took 130-175 ms and ~28,700 page faults where the schedule had
    just handed freed memory back, and now 13-47 ms and ~4,000 (alone: 12.9 against 16.3 ms);
    the prefill as a whole did not change, its other layers' tensors faulting in instead."""
    u, r, t, d = q.shape
    block = CAUSAL_ROWS_BLOCK
    out = torch.empty(u, r, t, d, dtype=q.dtype, device=q.device)
    above = torch.full((block, block), -math.inf, dtype=q.dtype, device=q.device).triu(1)
    units = max(1, min(CAUSAL_ROWS_MAX_SCORES // (r * block * t), cache_pieces.PIECE_ELEMENTS // (t * d)))
    for a0 in range(0, u, units):
        a1 = min(a0 + units, u)
        kt = _shifted_keys(k[a0:a1], None if lengths is None else lengths[a0:a1], q.dtype)  # (a1 - a0, d, t)
        for i0 in range(0, t, block):
            i1 = min(i0 + block, t)
            n = i1 - i0
            scores = torch.bmm(q[a0:a1, :, i0:i1].reshape(a1 - a0, r * n, d), kt[:, :, :i1])
            scores.view(a1 - a0, r, n, i1)[..., i0:i1].add_(above[:n, :n])
            out[a0:a1, :, i0:i1] = torch.bmm(scores.softmax(-1), v[a0:a1, :i1]).view(a1 - a0, r, n, d)
    return out


def _shifted_keys(k: torch.Tensor, lengths: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """_causal_rows's keys (u, t, d): the mean of each unit's real keys (its first lengths[u];
    None: all) taken out and 1/sqrt(d) put in, in float32, then rounded to `dtype`, (u, d, t)."""
    u, t, d = k.shape
    kf = k.float()
    if lengths is None:
        mean = kf.mean(1, keepdim=True)
    else:
        real = (torch.arange(t, device=k.device)[None, :] < lengths.to(k.device)[:, None])[..., None]
        mean = (kf * real).sum(1, keepdim=True) / real.sum(1, keepdim=True).clamp(min=1)
    return kf.sub_(mean).mul_(1 / math.sqrt(d)).to(dtype).transpose(1, 2)


def _left_padded_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                        window: int = 0) -> torch.Tensor:
    """Prompt attention when each unit's valid keys are its last `length` positions: every
    unit's rows are rotated so that its real tokens come first (its padding last), one
    fused causal call attends all of them at once, and the output is rotated back.

    A real query then sees exactly the real keys up to it (and within a sliding window, the
    same relative positions for every unit once rotated), as on its own, and the causal
    kernel skips the masked half; no (u, q, t) mask is built (gigabytes for long padded
    prompts), and no call runs per length (many small calls for a batch of short prompts).
    A padding query (rotated to the end) attends to what precedes it, which keeps it finite;
    nothing reads it: its keys are never valid.
    q: (u, r, t, d); k, v: (u, 1, t, d)."""
    u, r, t, d = q.shape
    shift = (t - lengths).to(q.device)  # each unit's padding
    ahead = (torch.arange(t, device=q.device)[None, :] + shift[:, None]) % t  # rotated row j <- row ahead[j]
    back = (torch.arange(t, device=q.device)[None, :] - shift[:, None]) % t
    first_row = t * torch.arange(u, device=q.device)[:, None]

    def rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # whole (heads x d) rows by index_select: torch.gather with an expanded index ran
        # far slower than a copy on CPU (slower than the attention itself at 512 tokens)
        h = x.shape[1]
        flat = x.transpose(1, 2).reshape(u * t, h * d)
        return flat.index_select(0, (index + first_row).flatten()).view(u, t, h, d).transpose(1, 2)

    out = _sdpa(rows(q, ahead), rows(k, ahead), rows(v, ahead), causal=True, window=window, lengths=lengths)
    return rows(out, back)


def _attention_dtype(q: torch.Tensor) -> torch.dtype:
    # CPU half-precision kernels are slow and lose accuracy; bfloat16 and float32 run fused
    if q.device.type == "cpu" and q.dtype == torch.float16:
        return torch.float32
    return q.dtype


def _top_k_attention(scores: torch.Tensor, v: torch.Tensor | ValueRows, key_valid: torch.Tensor,
                     keep_fraction: float) -> torch.Tensor:
    """Decode attention over each query's top keys; scores: (u, r, 1, t) masked with -inf."""
    u, r, _, t = scores.shape
    # per unit, in Python floats so that every policy rounds the same way
    keeps = [max(1, math.ceil(keep_fraction * n)) for n in key_valid.sum(-1).tolist()]
    top = scores.topk(max(keeps), dim=-1)  # sorted, best first: (u, r, 1, K)
    rank = torch.arange(top.indices.shape[-1], device=scores.device)
    kept = rank < torch.tensor(keeps, device=scores.device)[:, None]
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


def attend_past_held_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | ValueRows, own_valid: torch.Tensor,
                            prefix_keys: torch.Tensor, prefix_values: torch.Tensor, first_unit: int = 0,
                            keep_fraction: float = 1.0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention (one query per unit) where every sequence's cache holds the
    same first n positions of its prompt once for all (held_prefix.HeldPrefix: a compressed
    cache, or sparse attention): prefix_keys and prefix_values (kv_heads, n, d), as each
    row's copy of them reads. The units are whole sequences' (kv_heads units each, in order),
    q's the units first_unit, first_unit + 1, ... of them; k, v (u, t, d) hold the rest of
    each unit's cache, of which it may see those own_valid (u, t) says (where its slot still
    holds its own copy of the prefix, those are masked out).

    The prefix's scores are one matmul per key-value head for the queries of every sequence
    at once (Hydragen, cascade attention). keep_fraction 1: each part is normalised over its
    own keys and the two merge exactly by their log-sum-exps, as attend_past_shared_prefix's
    float32 parts. keep_fraction < 1: the top-k stays global, as attend()'s over each whole
    cache: a unit's n + own_valid keys are its visible ones, each query keeps its top
    ceil(keep_fraction * (n + own)) of the prefix's scores and its own side by side (scored
    as attend() scores them), the softmax is taken over those, and only the kept values are
    read (v, a ValueRows, is asked for its kept columns only). sinks (u, r): as attend()'s
    (keep_fraction 1 only), on the merged softmax. Float32, as attend()'s CPU decode path;
    returns (u, r, 1, d) in q's dtype."""
    u, r, _, d = q.shape
    kvh, n = prefix_keys.shape[0], prefix_keys.shape[1]
    if sinks is not None and keep_fraction < 1.0:
        raise ValueError("sparse attention does not compute attention sinks (check_sparse_attention)")
    qf = q.float().view(u, r, d)
    by_head, per_unit = _stacked_by_head(qf, first_unit, kvh)
    if keep_fraction == 1.0:
        v = v(list(range(k.shape[1]))) if callable(v) else v
        shared = _normalized_part(by_head, prefix_keys, prefix_values, softcap)
        return _own_keys_and_prefix(qf, k, v, own_valid, softcap, tuple(map(per_unit, shared)),
                                    sinks).view(u, r, 1, d).to(q.dtype)
    # the scores attend() computes over each whole cache, the prefix's first
    own = _capped(torch.bmm(qf, k.float().transpose(1, 2)) / math.sqrt(d), softcap)
    own = own.masked_fill_(~own_valid[:, None, :], -math.inf)
    shared = per_unit(_capped(torch.bmm(by_head, prefix_keys.float().transpose(1, 2)) / math.sqrt(d), softcap))
    scores = torch.cat([shared, own], dim=-1)  # (u, r, n + t)
    # per unit, in Python floats, as _top_k_attention rounds them
    keeps = [max(1, math.ceil(keep_fraction * (n + c))) for c in own_valid.sum(-1).tolist()]
    top = scores.topk(max(keeps), dim=-1)  # sorted, best first: (u, r, K)
    rank = torch.arange(top.indices.shape[-1], device=q.device)
    kept = (rank < torch.tensor(keeps, device=q.device)[:, None])[:, None, :]  # (u, 1, K)
    weights = top.values.masked_fill(~kept, -math.inf).softmax(-1)  # renormalised over the kept keys
    index = top.indices  # (u, r, K): the prefix's keys first, then the unit's own
    heads = (torch.arange(first_unit, first_unit + u, device=q.device) % kvh)[:, None, None]
    from_prefix = prefix_values.float()[heads, index.clamp(max=n - 1)]  # (u, r, K, d)
    columns = (index - n).clamp_(min=0)
    if callable(v):
        wanted = columns[kept.expand_as(index) & (index >= n)].unique()  # sorted
        if len(wanted) == 0:  # every query kept prefix keys only
            return torch.matmul(weights[:, :, None, :], from_prefix).to(q.dtype)
        v = v(wanted.tolist())  # (u, m, d): the kept columns only
        columns = torch.searchsorted(wanted, columns).clamp_(max=len(wanted) - 1)  # dropped ones: weight 0
    own_v = torch.gather(v.float()[:, None].expand(u, r, v.shape[1], d), 2,
                         columns[..., None].expand(*columns.shape, d))
    kept_values = torch.where((index < n)[..., None], from_prefix, own_v)
    return torch.matmul(weights[:, :, None, :], kept_values).to(q.dtype)


def attend_as_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                     as_stored: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     keep_fraction: float = 1.0, chunk: int = 128, window: int = 0, softcap: float = 0.0,
                     fresh_group: int = 1, starts: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt attention in which every position attends as a decode step of the engine
    would if it had generated that token: to the keys and values of the positions before
    it as the KV cache returns them (`as_stored(k, v)`: quantized, then dequantized, under
    cache compression), to those the cache still holds fresh, and, with keep_fraction < 1,
    only to its top ceil(keep_fraction * n) of the n keys it may see, renormalised (as
    _top_k_attention).

    Fresh: a query's own key and value (fresh_group 1, a per-token cache), or those of every
    position of its group of `fresh_group` (a KIVI cache's residual: the groups of unit u
    count from its first real position, starts[u]; default 0).

    Scoring with it measures what a compressed or sparse cache costs at every position (a
    plain prefill attends to fresh keys and values, so neither can change a score there).
    window, softcap and sinks (dense only) as in attend().
    q: (u, r, t, d); k, v: (u, t, d); key_valid: (u, t). Returns (u, r, t, d) in q's dtype."""
    if sinks is not None and keep_fraction < 1.0:
        raise ValueError("sparse attention does not compute attention sinks (check_sparse_attention)")
    u, r, t, d = q.shape
    k_c, v_c = (x.float() for x in as_stored(k, v))
    pos = torch.arange(t, device=q.device)
    offset = torch.zeros(u, 1, 1, dtype=torch.long, device=q.device) if starts is None else \
        starts.to(q.device).view(u, 1, 1)
    out = torch.empty(u, r, t, d, dtype=torch.float32, device=q.device)
    for c0 in range(0, t, chunk):
        c1 = min(c0 + chunk, t)
        b0 = max(0, c0 - fresh_group + 1)  # keys [b0, c1): all that may be fresh to the chunk's queries
        qc = q[:, :, c0:c1].float()
        scores = _capped(torch.matmul(qc, k_c.transpose(1, 2)[:, None]) / math.sqrt(d), softcap)  # (u, r, c, t)
        fresh = ((pos[c0:c1, None] - offset).div(fresh_group, rounding_mode="floor")
                 == (pos[None, b0:c1] - offset).div(fresh_group, rounding_mode="floor"))  # (u, c, c1 - b0)
        fresh_scores = _capped(torch.matmul(qc, k[:, None, b0:c1].float().transpose(2, 3)) / math.sqrt(d), softcap)
        scores[..., b0:c1] = torch.where(fresh[:, None], fresh_scores, scores[..., b0:c1])
        allowed = _allowed(key_valid, pos[c0:c1], causal=True, window=window)  # (u, c, t)
        scores = scores.masked_fill(~allowed[:, None], -math.inf)
        if keep_fraction < 1.0:
            scores = _keep_top(scores, allowed.sum(-1), keep_fraction)
        weights = _softmax(scores, sinks)
        # every key's value as stored, but the fresh ones' as they are
        fresh_minus_stored = (v[:, b0:c1].float() - v_c[:, b0:c1])[:, None]  # (u, 1, c1 - b0, d)
        fresh_weights = weights[..., b0:c1] * fresh[:, None]
        out[:, :, c0:c1] = torch.matmul(weights, v_c[:, None]) + torch.matmul(fresh_weights, fresh_minus_stored)
    return out.to(q.dtype)


def _keep_top(scores: torch.Tensor, visible: torch.Tensor, keep_fraction: float) -> torch.Tensor:
    """scores (u, r, c, t) with -inf where a query may not look, visible (u, c): keys each
    query may see. The scores of each query's top ceil(keep_fraction * visible) keys; -inf
    elsewhere. Rounded in float64, as _top_k_attention rounds in Python floats."""
    keeps = (visible.double() * keep_fraction).ceil().clamp(min=1).long()  # (u, c)
    top = scores.topk(int(keeps.max()), dim=-1)
    rank = torch.arange(top.indices.shape[-1], device=scores.device)
    kept_values = top.values.masked_fill(rank >= keeps[:, None, :, None], -math.inf)
    return torch.full_like(scores, -math.inf).scatter_(-1, top.indices, kept_values)


@dataclass(frozen=True)
class DecodePrefix:
    """A block's shared prefix at one layer, as decode steps read it (attend_past_shared_prefix).

    Exact (float32 on a CPU; the compute dtype elsewhere): keys and values (kv_heads, P, d) as
    computed. In bfloat16 on a CPU with bf16 arithmetic (prefix_for_decode): keys with their
    mean taken out, the 1/sqrt(d) scale and log2(e) in (scores in base 2), transposed to
    (kv_heads, d, P), values (kv_heads, P, d), both bfloat16, and key_mean (kv_heads, 1, d)
    float32 (mean / sqrt(d), natural base), so that the prefix's two matmuls a step run at
    bf16's rate (3-4x float32's on this project's CPU, runs/prefix_sharing/README.md) while its
    scores keep float32's precision where it matters: q . mean, the component every key
    shares, is added back in float32. by_position: the bf16 keys as (kv_heads, P, d) instead,
    where the prefix's use runs on torch's fused kernel (FUSED_PREFIX_PART), which must get
    them contiguous: over a transposed view it computed wrong scores (torch 2.13). Our products
    read such keys (the setting changed since: a profile's timing) as a transposed view, ~20%
    slower at a decode step's shapes (runs/prefix_sharing/decode_variants/keys_transposed_view.py),
    or a prefill window's as a transposed copy (_window_prefix_part)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_mean: torch.Tensor | None = None  # set: the bf16 layout above
    by_position: bool = False

    def keys_by_dim(self) -> torch.Tensor:
        """The bf16 layout's keys as (kv_heads, d, P), for our products' scores."""
        return self.keys.transpose(1, 2) if self.by_position else self.keys

    @property
    def length(self) -> int:
        return self.values.shape[1]


def prefix_for_decode(keys: torch.Tensor, values: torch.Tensor, device: torch.device, dtype: torch.dtype,
                      softcap: float = 0.0, use: str = "decode") -> DecodePrefix:
    """The prefix keys and values (kv_heads, P, d) of one layer in the layout decode steps of
    a `dtype` model on `device` read them in (DecodePrefix), converted once per block. The
    bf16 layout needs scores that a shift leaves the softmax of (no softcap: tanh is not
    shift-invariant) and native bf16 matmuls (emulated ones are slower than float32); its keys
    by position where its use (PREFIX_PART_USES: the decode steps', or the prefill windows')
    runs on the fused kernel (FUSED_PREFIX_PART)."""
    device = torch.device(device)
    if device.type == "cpu" and dtype == torch.bfloat16 and not softcap and _bf16_matmuls_native():
        kf = keys.to(torch.float32, copy=True).mul_(1 / math.sqrt(keys.shape[-1]))
        mean = kf.mean(1, keepdim=True)
        centred = kf.sub_(mean).mul_(1 / math.log(2)).to(dtype)
        by_position = use in FUSED_PREFIX_PART.get(device.type, ())
        kt = (centred if by_position else centred.transpose(1, 2)).contiguous()  # a cache's view keeps its strides
        return DecodePrefix(kt, values.to(dtype).contiguous(), mean, by_position)
    read_as = decode_cache_dtype(device, dtype)
    return DecodePrefix(keys.to(read_as, copy=True), values.to(read_as, copy=True))


def attend_past_shared_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own: torch.Tensor,
                              prefix: DecodePrefix, first_unit: int = 0, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention (one query per unit) where every sequence's cache holds the
    same prefix, under dense attention over a plain cache (a compressed cache's, or sparse
    attention's: attend_past_held_prefix). The units are whole sequences' (kv_heads units
    each, in order), q's the units first_unit, first_unit + 1, ... of them; `own` (u, t) marks
    the keys of k, v each may see outside its copy of the prefix (KVCacheSlot.outside_prefix:
    the same for every layer of a step, so made once a step). The prefix part is one matmul
    per key-value head for the queries of every sequence at once against its one copy
    (prefix: DecodePrefix), as Hydragen and cascade attention compute it, so it is read once
    a step instead of once per sequence; the rest attends per unit to its own keys; the parts
    merge exactly by their log-sum-exp (and sinks (u, r), as attend()'s, apply once to the
    merged softmax). q: (u, r, 1, d); k, v: (u, t, d). Float32, as attend()'s CPU decode
    path, but for the prefix's matmuls in DecodePrefix's bf16 layout; returns (u, r, 1, d) in
    q's dtype."""
    u, r, _, d = q.shape
    kvh = prefix.values.shape[0]
    if (prefix.by_position and sinks is None and not softcap and not callable(v)
            and q.dtype == k.dtype == v.dtype == prefix.values.dtype and k.stride(-1) == v.stride(-1) == 1
            and "decode" in FUSED_PREFIX_PART.get(q.device.type, ())):
        return _fused_past_prefix(q, k, v, own, prefix, first_unit)
    qf = q.float().view(u, r, d)
    by_head, per_unit = _stacked_by_head(qf, first_unit, kvh)
    if prefix.key_mean is None:
        shared = _normalized_part(by_head, prefix.keys, prefix.values, softcap)
    else:
        shared = _bf16_prefix_part(by_head, prefix)
    return _own_keys_and_prefix(qf, k, v, own, softcap, tuple(map(per_unit, shared)),
                                sinks).view(u, r, 1, d).to(q.dtype)


def _fused_past_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own: torch.Tensor,
                       prefix: DecodePrefix, first_unit: int) -> torch.Tensor:
    """attend_past_shared_prefix where the device's decode steps take torch's fused kernel for
    the prefix's part (FUSED_PREFIX_PART; its keys by position) and the cache is bf16 as the
    queries: the own keys on the same kernel, one call for every unit (the valid keys as an
    additive mask), and the two parts merged by their log-sum-exps as a lerp from the own
    part's output to the prefix part's, by the prefix's share of the softmax, sigmoid(lse_prefix
    - lse_own). Where our products take 44 torch ops a layer, this takes 22: at a decode step's
    shapes the ops' fixed cost is much of the difference (runs/prefix_sharing/decode_call_parts.py).
    Both parts round their weights to bf16 for the values, as the fused decode step without
    a prefix does (fused_decode); the lerp runs in float32, and the output is rounded once
    (a lerp of the parts' bf16 outputs by a bf16 share doubled the error against float32
    attention in tests/test_prefix_sharing.py's case of keys with a large shared part). The
    kernel reads the cache as the schedule's views give it (each position's row contiguous,
    checked by the caller: over other strides it computed wrong outputs). A unit that sees
    none of its own keys gets the prefix's part alone (HIDDEN_SCORE). Units of a tier whose
    cache is unpacked to float32 (a loaded or compressed one's) keep our products, over these
    by-position keys' transposed view."""
    u, r, _, d = q.shape
    t = k.shape[1]
    by_head, per_unit = _stacked_by_head(q.view(u, r, d), first_unit, prefix.values.shape[0])
    prefix_out, prefix_lse = map(per_unit, _fused_prefix_part(by_head, prefix))
    hidden = torch.where(own, *_mask_scores(q.device, q.dtype))  # 0 where a key is seen, HIDDEN_SCORE where not
    own_out, own_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.view(1, u, r, d), k[None], v[None], attn_mask=hidden.view(1, u, 1, t), scale=1 / math.sqrt(d))
    share = torch.sigmoid(prefix_lse.view(u, r, 1) - own_lse.view(u, r, 1))
    return torch.lerp(own_out.view(u, r, d).float(), prefix_out.float(), share).to(q.dtype).view(u, r, 1, d)


# The additive mask's score for a key a fused decode call's own part does not see: finite,
# because the kernel returns a log-sum-exp of 0 for a row of -inf scores, where this one gives
# ~HIDDEN_SCORE, so the prefix's share of the merge is exactly 1 in float32 and such a unit
# gets the prefix's part alone. Any real score is within a few hundred of 0, so a hidden key's
# weight beside a seen one underflows to exactly 0 in float32 (below e^-104), as -inf's does.
HIDDEN_SCORE = -30000.0


@lru_cache(maxsize=None)
def _mask_scores(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive mask's two values (seen 0, hidden HIDDEN_SCORE) as 0-dim tensors in the
    queries' dtype, so that one torch.where makes the mask in that dtype."""
    return (torch.zeros((), dtype=dtype, device=device),
            torch.full((), HIDDEN_SCORE, dtype=dtype, device=device))


# attend_window_past_shared_prefix: the scores (float32) one product holds at most
WINDOW_MAX_SCORES = 1 << 22


def attend_window_past_shared_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                                     prefix: DecodePrefix, softcap: float = 0.0,
                                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill's attention where every row's keys begin with the same prefix, which all of its
    queries see whole: q (u, r, s, d), the queries of the last s of the columns of k, v (u, t,
    d), the keys after the prefix (causal over them, those key_valid (u, t) marks); prefix
    (DecodePrefix): the keys before, of whole sequences (kv_heads units each, u of them in all).
    The prefix part is one product per key-value head for the queries of every row at once
    (attend_past_shared_prefix's, Hydragen's), where attention over each row's copy of the
    prefix read it once per row: a few-shot block's suffix prefill at SmolLM2's shapes spent
    more in that than in its own linears (runs/prefix_sharing/README.md). The rest attends per
    unit to its own keys and the parts merge by their log-sum-exp (_own_keys_and_prefix, in
    float32; _own_window_bf16, its products in bf16, where the prefix part's are:
    DecodePrefix); sinks (u, r) apply once to the merged softmax. Returns (u, r, s, d) in q's
    dtype."""
    u, r, s, d = q.shape
    t, m = k.shape[1], r * s
    qf = q.float().reshape(u, m, d)
    shared_out, shared_lse = _window_prefix_part(qf, prefix, softcap)
    causal = torch.arange(t, device=q.device)[None, :] <= torch.arange(t - s, t, device=q.device)[:, None]
    sinks = None if sinks is None else sinks[:, :, None].expand(u, r, s).reshape(u, m)
    in_bf16 = q.dtype == torch.bfloat16 and q.device.type == "cpu" and not softcap and _bf16_matmuls_native()
    out = torch.empty(u, m, d, device=q.device)
    units = max(1, WINDOW_MAX_SCORES // (m * (t + 1)))
    for a in range(0, u, units):
        b = min(u, a + units)
        shared, sink = (shared_out[a:b], shared_lse[a:b]), None if sinks is None else sinks[a:b]
        if in_bf16:  # the mask as (units, 1, s, t): each query head of a unit sees the same keys
            hidden = ~key_valid[a:b, None, None, :] | ~causal
            _own_window_bf16(q[a:b].reshape(b - a, m, d), qf[a:b], k[a:b], v[a:b], hidden, shared, sink, out[a:b])
        else:
            valid = (key_valid[a:b, None, None, :] & causal).expand(b - a, r, s, t).reshape(b - a, m, t)
            out[a:b] = _own_keys_and_prefix(qf[a:b], k[a:b], v[a:b], valid, softcap, shared, sink)
    return out.view(u, r, s, d).to(q.dtype)


def _window_prefix_part(qf: torch.Tensor, prefix: DecodePrefix, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix part (output, log-sum-exp) of window queries qf (u, m, d), float32, of whole
    sequences (kv_heads units each), in the units' layout: one product per key-value head for a
    slice of the sequences at a time (of whole sequences while one's scores fit
    WINDOW_MAX_SCORES, else of one sequence's rows), each slice's result copied into its
    place, where joining the slices and reordering them by unit were two more passes over all
    of it (runs/prefix_sharing/window_passes.py). The slices follow the shapes only, so every
    policy slices a block alike; a row's last bits may follow its slice's size (the products'
    kernels block their rows by it), and on our products a slice whose scores leave the
    normal floats is taken again with the peak out (_bf16_prefix_part). Keys laid out by
    position for the kernel, where the windows take our products, are copied transposed once
    a call: over their transposed view the windows' prefix part took 4-8% longer on a few-shot
    HELM scenario's requests (runs/helm_vs_hf/natural_parts/prefix_path_ab.jsonl). Our products
    take the weights' sums out of the product with the values (_bf16_prefix_part's
    values_and_ones, made once a call)."""
    u, m, d = qf.shape
    fused = prefix.by_position and "window" in FUSED_PREFIX_PART.get(qf.device.type, ())
    if prefix.by_position and not fused:
        prefix = replace(prefix, keys=prefix.keys_by_dim().contiguous(), by_position=False)
    with_ones = None if prefix.key_mean is None or fused else _values_and_ones(prefix.values)
    kvh, keys = prefix.values.shape[0], prefix.length
    sequences, per_sequence = u // kvh, kvh * m * keys
    if per_sequence <= WINDOW_MAX_SCORES:
        at_once, rows = WINDOW_MAX_SCORES // per_sequence, m
    else:
        at_once, rows = 1, max(1, WINDOW_MAX_SCORES // (kvh * keys))
    out, lse = qf.new_empty(u, m, d), qf.new_empty(u, m, 1)

    def by_sequence(x: torch.Tensor) -> torch.Tensor:
        return x.view(sequences, kvh, m, x.shape[-1])

    for a in range(0, sequences, at_once):
        b = min(sequences, a + at_once)
        for c in range(0, m, rows):
            e = min(m, c + rows)
            queries = by_sequence(qf)[a:b, :, c:e].transpose(0, 1).reshape(kvh, (b - a) * (e - c), d)
            if prefix.key_mean is None:
                part = _normalized_part(queries, prefix.keys, prefix.values, softcap)
            elif fused:
                out_bf16, part_lse = _fused_prefix_part(queries, prefix)
                part = out_bf16.float(), part_lse
            else:
                part = _bf16_prefix_part(queries, prefix, with_ones)
            for whole, piece in zip((out, lse), part):
                by_sequence(whole)[a:b, :, c:e].copy_(piece.view(kvh, b - a, e - c, -1).transpose(0, 1))
    return out, lse


def _own_window_bf16(q: torch.Tensor, qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                     prefix: tuple[torch.Tensor, torch.Tensor], sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    """_own_keys_and_prefix of a prefill window in bfloat16 on a CPU with bf16 arithmetic (no
    softcap), into out (u, m, d) float32: its two products over each unit's own columns in
    bf16 (a window's own part in float32 was most of attend_window_past_shared_prefix's time
    at SmolLM2's shapes), the keys' mean taken out before their rounding as _causal_rows does,
    and q . mean / sqrt(d), the part every key of a query shares, taken out of the prefix's
    log-sum-exp (and the sink) instead, so that all the softmax's entries move alike. q: (u,
    m, d), k, v: bf16; qf: q in float32; hidden (u, 1, s, t): the columns the last s queries
    of each unit's m (r query heads of s positions) do not see.

    The softmax's inputs are written into one tensor, own scores then the prefix's (and the
    sink's) column, and the output is the prefix's part with the own part added in place:
    each pass over these (u, m, t) tensors is a pass over tens of MB at a few-shot block's
    shapes, and a concatenation, a widening copy and a mask expanded over the query heads
    were three more of them (runs/prefix_sharing/window_passes.py). The same bits as
    computing them apart: the same values go into the softmax, and float addition commutes."""
    u, m, d = q.shape
    t = k.shape[1]
    scale = 1 / math.sqrt(d)
    kf = k.float()
    mean = kf.mean(1, keepdim=True)
    shift = torch.bmm(qf, mean.transpose(1, 2)).mul_(scale)  # (u, m, 1)
    keys = kf.sub_(mean).mul_(scale).to(torch.bfloat16).transpose(1, 2)
    prefix_out, prefix_lse = prefix
    scores = torch.empty(u, m, t + (1 if sinks is None else 2), device=q.device)
    own_scores = scores[..., :t]
    own_scores.copy_(torch.bmm(q, keys))
    own_scores.unflatten(1, (-1, hidden.shape[-2])).masked_fill_(hidden, -math.inf)
    torch.sub(prefix_lse, shift, out=scores[..., t:t + 1])
    if sinks is not None:
        torch.sub(sinks.float()[..., None], shift, out=scores[..., t + 1:])
    weights = scores.softmax(-1)
    torch.mul(weights[..., t:t + 1], prefix_out, out=out).add_(torch.bmm(weights[..., :t].to(torch.bfloat16), v))


def _stacked_by_head(qf: torch.Tensor, first_unit: int, kvh: int) -> tuple[torch.Tensor, Callable]:
    """Queries (u, r, d) of the units first_unit, first_unit + 1, ... of whole sequences
    (kv_heads units each) as the rows of one product per key-value head: (kv_heads,
    sequences * r, d), over the whole sequences they lie in (the units of a sequence outside
    them ask with zero queries); and the map of a result (kv_heads, sequences * r, m) back to
    the units' (u, r, m), those zero queries dropped."""
    u, r, d = qf.shape
    lead = first_unit % kvh
    sequences = -(-(lead + u) // kvh)
    if lead or u != sequences * kvh:
        qf = torch.cat([qf.new_zeros(lead, r, d), qf, qf.new_zeros(sequences * kvh - lead - u, r, d)])
    by_head = qf.view(sequences, kvh, r, d).transpose(0, 1).reshape(kvh, sequences * r, d)

    def per_unit(x: torch.Tensor) -> torch.Tensor:
        return x.view(kvh, sequences, r, -1).transpose(0, 1).reshape(sequences * kvh, r, -1)[lead:lead + u]

    return by_head, per_unit


def _own_keys_and_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, softcap: float,
                         prefix: tuple[torch.Tensor, torch.Tensor], sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention of q (u, r, d) over its own keys k, v (u, t, d), those valid
    (u, t) may see (or (u, r, t): each query its own, as a prefill window's), and the shared
    prefix's part, (output, log-sum-exp) normalised over the prefix's keys alone
    (_normalized_part, _bf16_prefix_part): (u, r, d), float32. The prefix
    enters the softmax as one more key, whose score is its log-sum-exp and whose value its
    output: exp(lse) is the prefix's exp-sum, so this softmax is the one over all the keys,
    and the output the whole attention's. A sink (u, r) (gpt-oss) is one more key again, of
    value 0: it adds exp(sink) to the denominator and nothing to the output. One fused
    softmax and one matmul with an add: fewer passes over these small tensors than a
    normalised own part merged afterwards (runs/prefix_sharing/README.md)."""
    prefix_out, prefix_lse = prefix
    t = k.shape[1]
    scores = _capped(torch.bmm(q * (1 / math.sqrt(q.shape[-1])), k.float().transpose(1, 2)), softcap)
    scores = scores.masked_fill_(~(valid if valid.dim() == 3 else valid[:, None, :]), -math.inf)
    extra = [prefix_lse] if sinks is None else [prefix_lse, sinks.to(q.device, torch.float32)[..., None]]
    weights = torch.cat([scores, *extra], -1).softmax(-1)
    return torch.baddbmm(weights[..., t:t + 1] * prefix_out, weights[..., :t], v.float())


# _bf16_prefix_part: the base-2 log-sum-exp within which a prefix part's weights, taken
# without their peak, stay normal floats (bf16 has float32's exponent range, 2^-126..2^127).
# Above it a weight or a sum over many keys could overflow. Below it the peak weight would
# lose bits; the layout's keys are centred, so a row's scores average ~0 and its log-sum-exp
# is at least ~0: the lower bound guards other inputs only.
UNSHIFTED_LSE2_BOUND = 100.0


# Where a bf16 shared prefix's part of attention runs on torch's fused CPU flash kernel, which
# returns the log-sum-exp the merge needs, instead of our products (_bf16_prefix_part): a decode
# step's call (_fused_past_prefix, its own keys on the kernel too) and a prefill window's prefix
# part, each chosen apart
PREFIX_PART_USES = ("decode", "window")
# Device type -> the uses that take the fused kernel: those `flexgen-helm profile` timed faster
# there (planner/hardware_profile.use_profile; DeviceSpeeds.attn_prefix_fused_gains). On the
# 2-core EPYC the kernel was slower than our whole decode step
# (runs/prefix_sharing/prefix_part_kernels_2026-11-28.txt); on the 2-core Xeon with AMX it gains
# at decode (runs/prefix_sharing/decode_call_parts_fused_2026-11-29.txt) and not at a prefill
# window (runs/helm_vs_hf/natural_parts/prefix_path_ab.jsonl).
FUSED_PREFIX_PART: dict[str, frozenset[str]] = {"cpu": frozenset()}


def set_fused_prefix_part(device_type: str, uses: Iterable[str]) -> frozenset[str]:
    """Which uses (PREFIX_PART_USES) of a bf16 shared prefix's part take the fused kernel on
    `device_type` for prefixes made from now on (prefix_for_decode lays their keys out for it);
    returns the setting before."""
    if device_type not in FUSED_PREFIX_PART:
        raise ValueError(f"the prefix part's path is chosen on {', '.join(FUSED_PREFIX_PART)}, not {device_type!r}")
    uses = frozenset(uses)
    if not uses <= set(PREFIX_PART_USES):
        raise ValueError(f"the prefix part's uses are {', '.join(PREFIX_PART_USES)}, not {', '.join(sorted(uses))}")
    before, FUSED_PREFIX_PART[device_type] = FUSED_PREFIX_PART[device_type], uses
    return before


def _fused_prefix_part(q: torch.Tensor, prefix: DecodePrefix) -> tuple[torch.Tensor, torch.Tensor]:
    """_bf16_prefix_part of queries q (kv_heads, m, d) on torch's fused CPU flash kernel, over
    keys by position (DecodePrefix.by_position): the layout's keys carry 1/(sqrt(d) ln 2), so a
    scale of ln 2 gives the natural-base scores relative to the keys' mean; the kernel keeps
    them in float32 (ours rounds them to bf16) and rounds the weights to bf16 for the values,
    as ours does; its log-sum-exp is natural, and q . mean goes back into it in float32. The
    output is the kernel's, in bf16."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(prefix.values.dtype)[None], prefix.keys[None], prefix.values[None], scale=math.log(2))
    return out[0], torch.baddbmm(lse[0, :, :, None], q.float(), prefix.key_mean.transpose(1, 2))


def _bf16_prefix_part(q: torch.Tensor, prefix: DecodePrefix,
                      values_and_ones: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """_normalized_part of float32 queries q (kv_heads, m, d) over a prefix in DecodePrefix's
    bf16 layout: the scores leave their matmul rounded to bf16 relative to the keys' mean, in
    base 2 (the layout's keys carry log2(e)), and are exponentiated in place, in bf16, as
    the weights the product with the values takes; their sum is taken in float32. q . mean,
    the component every key shares, goes back into the log-sum-exp in float32.

    values_and_ones (_values_and_ones of the prefix's values, a prefill window's): the sums
    come out of the product with the values instead, as its column d, rounded to bf16 (up to
    ~2^-8 of a sum, against float32's exact sum), where summing a window's weights apart was a
    quarter of this part's time, their widening to float32 most of it
    (runs/prefix_sharing/decode_variants/sums_in_the_product.py).

    The scores are relative to the keys' mean already, so their exponentials are taken
    without subtracting each row's peak first: a softmax is the same for any shift, and a
    weight's rounding is relative, so this rounds as the shifted weights would. It saves
    the passes of the peak, its subtraction and two conversions: 9-10% of this part at
    SmolLM2's decode shapes, 10-16% at a few-shot prefill window's
    (runs/prefix_sharing/decode_variants/unshifted_weights.py). Where a
    row's log-sum-exp leaves +-UNSHIFTED_LSE2_BOUND (a head whose queries meet its keys at
    scores of ~100 and more), the row's weights may have left the normal floats, and the
    part is taken again with the peak out (_shifted_bf16_prefix_part)."""
    weights = torch.bmm(q.to(prefix.values.dtype), prefix.keys_by_dim()).exp2_()
    d = prefix.values.shape[-1]
    if values_and_ones is None:
        products, total = None, _row_sums(weights)
    else:
        products = torch.bmm(weights, values_and_ones)
        total = products[..., d:d + 1].float()
    lse2 = total.log2()
    low, high = lse2.aminmax()
    if not (-UNSHIFTED_LSE2_BOUND < low.item() and high.item() < UNSHIFTED_LSE2_BOUND):  # also NaN
        return _shifted_bf16_prefix_part(q, prefix)
    out = (torch.bmm(weights, prefix.values) if products is None else products[..., :d]).div(total)  # float32
    return out, torch.baddbmm(lse2, q, prefix.key_mean.transpose(1, 2), beta=math.log(2))


def _values_and_ones(values: torch.Tensor) -> torch.Tensor:
    """values (kv_heads, P, d) and a column of ones after them, zeros up to a multiple of 16
    columns (the bf16 matmul's tiles), so that their product with a part's weights holds each
    row's sum of the weights in column d (_bf16_prefix_part)."""
    kvh, n, d = values.shape
    out = values.new_zeros(kvh, n, -(-(d + 1) // 16) * 16)
    out[..., :d] = values
    out[..., d] = 1
    return out


# _row_sums: the most elements widened to float32 at once (2 MiB of them)
ROW_SUM_ELEMENTS = 1 << 19


def _row_sums(weights: torch.Tensor) -> torch.Tensor:
    """Each row's sum (g, m, 1), float32, of bf16 weights (g, m, n), a slice of the rows at a
    time: torch sums bf16 into float32 by widening the whole input first, and a prefill
    window's 4M weights widened at once go out to memory and back, where a slice's stay in
    the core's cache. The slices are of the rows flattened, so each is contiguous (slices
    across the g heads' rows took 3x one whole sum at a decode step's 3 x 96 x 1000), and a
    decode step's weights sum in one call (runs/prefix_sharing/README.md, "Row sums"). A
    row's sum is the same in any slicing. `weights`: contiguous (a product's output), so that
    its rows flatten as a view."""
    g, m, n = weights.shape
    rows = max(1, ROW_SUM_ELEMENTS // n)
    if rows >= g * m:
        return weights.sum(-1, keepdim=True, dtype=torch.float32)
    flat = weights.view(g * m, n)
    total = weights.new_empty(g * m, 1, dtype=torch.float32)
    for a in range(0, g * m, rows):
        torch.sum(flat[a:a + rows], -1, keepdim=True, dtype=torch.float32, out=total[a:a + rows])
    return total.view(g, m, 1)


def _shifted_bf16_prefix_part(q: torch.Tensor, prefix: DecodePrefix) -> tuple[torch.Tensor, torch.Tensor]:
    """_bf16_prefix_part with each row's peak score taken out before the exponentials, for
    scores whose unshifted weights would leave the normal floats: the scores widened to
    float32, exponentiated and summed there, the weights rounded to bf16 for the product
    with the values (the sum of the unrounded weights differs from the rounded ones' by their
    rounding, 2^-9 relative at most)."""
    scores = torch.bmm(q.to(prefix.values.dtype), prefix.keys_by_dim()).float()
    peak = scores.amax(-1, keepdim=True)
    weights = scores.sub_(peak).exp2_()
    total = weights.sum(-1, keepdim=True)
    out = torch.bmm(weights.to(prefix.values.dtype), prefix.values).float().div_(total)
    return out, (peak + total.log2_()).mul_(math.log(2)).add_(torch.bmm(q, prefix.key_mean.transpose(1, 2)))


def _normalized_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (g, m, d) over all the keys k, v (g, t, d), normalised over these keys
    alone, as the part a two-part softmax merges from (_own_keys_and_prefix): the output (g,
    m, d) and each row's log-sum-exp of its scores (g, m, 1).

    A shared prefix's scores are every sequence's queries against all of its keys, so each
    pass over them costs a good part of its matmuls: the scale goes on the (few) queries, the
    scores are taken in base 2, and the passes run in place. torch's exp2 ran 2x its exp on
    this project's AVX2 CPU, and faster than its fused softmax (which gives no log-sum-exp):
    runs/prefix_sharing/README.md."""
    scale = 1 / math.sqrt(q.shape[-1])
    if softcap:
        scores = _capped(torch.bmm(q * scale, k.float().transpose(1, 2)), softcap).mul_(LOG2_E)
    else:
        scores = torch.bmm(q * (scale * LOG2_E), k.float().transpose(1, 2))
    peak = scores.amax(-1, keepdim=True)
    weights = scores.sub_(peak).exp2_()
    total = weights.sum(-1, keepdim=True)  # >= 1: its largest score's weight
    return torch.bmm(weights, v.float()).div_(total), (peak + total.log2()) * math.log(2)
