"""A block's shared prompt prefix held once, for decode steps over a compressed KV cache or
with sparse attention (stored dense where the cache is: no compression, or a compressed cache
held dense, its values rounded: rounded_prefix); a dense cache's dense attention reads
attention.DecodePrefix.

Every row's prompt starts with the prefix, left-padded, so every row's copy of it is the
same keys and values at the same offsets from its first real token, and is stored alike:
a per-token group is one position's row of one unit, so the prefix quantized once is each
row's codes; KIVI's groups count from a row's first real token, so the prefix's complete
groups (its first floor(P / G) * G positions, kv_cache.held_prefix_len) are each row's
first groups, while its last, partial group fills up with the row's own tokens and stays in
the row's slot. The block keeps that one stored form (compressed as the slots store it,
where decode attention runs), and its slots hold out the positions it covers
(kv_cache.KVCacheSlot's held_out, kivi_cache.KiviCacheSlot's held_out_groups).

A decode step dequantizes the copy once a layer where attention runs, into the values each
row's copy would have given (the slots' own dequantization, bit for bit), and every GPU batch
and tier attending there at that step reads them (attention.attend_past_held_prefix)."""

from __future__ import annotations

import torch

from flexgen_helm.compression.kivi import KiviGroups, quantize_groups, rounded_groups
from flexgen_helm.compression.quantize import CACHE_GROUP_DIM, fake_quantize
from flexgen_helm.compression.stored import Stored, dense_into, encode
from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.executor.kv_cache import held_prefix_len, kv_nbytes
from flexgen_helm.policy.policy import Compression, Policy


def reads_prefix_as_stored(policy: Policy) -> bool:
    """Whether decode steps read a block's held prefix as the slots store it (HeldPrefix):
    under cache compression (its values are each row's dequantized ones) or sparse attention
    (its keys ranked with each row's own); a plain cache's dense attention reads the copy as
    computed (attention.DecodePrefix), a cache whose values are held dense too
    (Policy.keep_dense_cache: the copy then holds them rounded)."""
    return policy.cache_storage is not None or policy.attn_sparsity < 1.0


def rounded_prefix(keys: torch.Tensor, values: torch.Tensor, cfg: Compression, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values: (kv_heads, P, d) of one layer, as computed -> the positions of them a
    block holds once (held_prefix_len), as every row's slot holds them where the compressed
    cache is held dense (Policy.keep_dense_cache): in `dtype`, rounded per token, or under
    KIVI as its complete groups dequantize."""
    n = held_prefix_len(keys.shape[1], cfg)
    k, v = (x[:, :n].to(dtype) for x in (keys, values))
    if cfg.kivi:
        k, v = rounded_groups(k.transpose(0, 1), v.transpose(0, 1), cfg)  # as a slot's (positions, units, d)
        return k.transpose(0, 1), v.transpose(0, 1)
    return fake_quantize(k, cfg, CACHE_GROUP_DIM), fake_quantize(v, cfg, CACHE_GROUP_DIM)


def unpacked_nbytes(positions: int, kv_heads: int, head_dim: int, dtype: torch.dtype, read_as: torch.dtype,
                    cfg: Compression | None) -> int:
    """Bytes of what a decode step unpacks a HeldPrefix of `positions` into, to read in
    `read_as` (HeldPrefix.unpack): none where a plain copy is stored in that dtype."""
    if cfg is None and read_as == dtype:
        return 0
    return kv_nbytes(positions, kv_heads, head_dim, read_as, None)


class HeldPrefix:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cfg: Compression | None, dtype: torch.dtype,
                 device: torch.device):
        """keys, values: (kv_heads, P, d) of one layer, as computed; stored in `dtype` (the
        cache's) as the slots store them, quantized where they were computed (as a slot's
        write quantizes), then moved to `device`."""
        self.length = held_prefix_len(keys.shape[1], cfg)
        k, v = (x[:, :self.length].transpose(0, 1).to(dtype) for x in (keys, values))  # (n, kv_heads, d), a slot's
        if cfg is not None and cfg.kivi:
            self.stored: KiviGroups | tuple[Stored, Stored] = quantize_groups(k, v, cfg).to(device)
        else:
            gd = None if cfg is None else CACHE_GROUP_DIM
            self.stored = tuple(encode(x.contiguous(), cfg, gd).to(device) for x in (k, v))

    @property
    def nbytes(self) -> int:
        """What it holds (kv_cache.held_prefix_nbytes)."""
        return sum(p.nbytes for p in ((self.stored,) if isinstance(self.stored, KiviGroups) else self.stored))

    def unpack(self, dtype: torch.dtype, buffers: CacheBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (kv_heads, n, d) in `dtype`, where it lives, as a slot's unpack
        gives every row's copy: in `buffers` (the last unpack's are overwritten: unpacked_nbytes),
        or a plain copy's own storage where it is in `dtype` already."""
        if isinstance(self.stored, KiviGroups):
            n, units, d = self.length, self.stored.key.shape[1], self.stored.key.shape[2]
            keys, values = self._buffers(buffers, (units, n, d), dtype, self.stored.device)
            self.stored.dequantize_into(keys, values, buffers.scratch(self.stored.device))
            return keys, values
        k, v = self.stored
        if isinstance(k, torch.Tensor) and k.dtype == dtype:
            return k.transpose(0, 1), v.transpose(0, 1)
        n, units, d = k.shape
        keys, values = self._buffers(buffers, (units, n, d), dtype, k.device)
        for stored, out in zip(self.stored, (keys, values)):
            dense_into(stored, out.transpose(0, 1), buffers.scratch(k.device))
        return keys, values

    @staticmethod
    def _buffers(buffers: CacheBuffers, shape: tuple, dtype: torch.dtype, device: torch.device):
        return (buffers.take("prefix-keys", shape, dtype, device), buffers.take("prefix-values", shape, dtype, device))
