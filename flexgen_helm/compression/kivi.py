"""KIVI grouping of a quantized KV cache (Liu et al., 2024): keys per channel, values per token.

Keys have a few channels far larger than the rest in every token. A group along head_dim
(one token's row: FlexGen's grouping, "per-token") must stretch its 2^bits levels over such
a channel, so every other channel of the row gets coarse steps; a group along the tokens of
one channel keeps that channel's range to itself. Values have no such channels and stay
grouped per token, along head_dim (in groups of min(group_size, head_dim)).

A group of keys spans `group_size` (G) consecutive positions of one sequence, so it can be
quantized only once they all exist: the newest positions of an unfinished group (fewer than
G) stay in full precision (the residual), and their keys and values are quantized together
when the group completes. Groups count from a sequence's first real token, not from the
first row of a left-padded batch, so padding (hence which sequences share a batch) changes
no number.

`KiviGroups` holds n complete groups of `units` units (sequence x key-value head):
    key:   QuantizedTensor of shape (n * G, units, d), groups along dim 0 (the tokens);
    value: QuantizedTensor of shape (n, units, G, d), groups along dim 3 (head_dim).
Every part has the leading dims (group, unit), so one (group, unit)'s bytes are one block
(`to_blocks`): a disk tier writes a completed group of a unit in one piece and reads the
groups of all its units in one range."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from flexgen_helm.compression.bundle import TensorBundle
from flexgen_helm.compression.quantize import (
    QuantizedTensor,
    Scratch,
    dequantize,
    dequantize_into,
    fake_quantize,
    quantize,
)
from flexgen_helm.policy.policy import Compression


def value_group_size(cfg: Compression, head_dim: int) -> int:
    """Values are grouped along head_dim: in groups of group_size, or the whole row when it is
    shorter (a wider group would only pad the codes)."""
    return min(cfg.group_size, head_dim)


def _key_cfg(cfg: Compression) -> Compression:
    return Compression(cfg.bits, cfg.group_size, method=cfg.method)


def _value_cfg(cfg: Compression, head_dim: int) -> Compression:
    return Compression(cfg.bits, value_group_size(cfg, head_dim), method=cfg.method)


@dataclass(frozen=True, eq=False)
class KiviGroups(TensorBundle):
    key: QuantizedTensor  # (n * G, units, d), group_dim 0
    value: QuantizedTensor  # (n, units, G, d), group_dim 3

    @classmethod
    def zeros(cls, n: int, units: int, head_dim: int, dtype: torch.dtype, cfg: Compression, device="cpu",
              pin_memory: bool = False) -> "KiviGroups":
        """Storage for n groups, all zero (they dequantize to zeros: a slot never read as a
        valid key is still finite, so its zero attention weight keeps the output finite)."""
        G = cfg.group_size
        out = cls(QuantizedTensor.empty((n * G, units, head_dim), dtype, _key_cfg(cfg), 0, device, pin_memory),
                  QuantizedTensor.empty((n, units, G, head_dim), dtype, _value_cfg(cfg, head_dim), 3, device,
                                        pin_memory))
        if str(device) != "meta":
            for p in out.parts:
                p.zero_()
        return out

    @property
    def groups(self) -> int:
        return self.value.shape[0]

    @property
    def group_size(self) -> int:
        return self.value.shape[2]

    def first(self, n: int) -> "KiviGroups":
        """Groups [0, n): views."""
        return KiviGroups(self.key.narrow(0, 0, n * self.group_size), self.value.narrow(0, 0, n))

    def at(self, j: int) -> "KiviGroups":
        """Group j alone: views."""
        return KiviGroups(self.key.narrow(0, j * self.group_size, self.group_size), self.value.narrow(0, j, 1))

    def put(self, slots: torch.Tensor, units: torch.Tensor, new: "KiviGroups", picked: torch.Tensor,
            into: torch.Tensor | None = None) -> None:
        """Group slots[i] of unit into[i] := group picked[i] of new's unit units[i] (into: units)."""
        into = units if into is None else into
        for dst, src in zip(self.parts, new.parts):
            taken = src[picked.to(src.device), units.to(src.device)]
            dst[slots.to(dst.device), into.to(dst.device)] = taken.to(dst.device)

    def to_blocks(self) -> torch.Tensor:
        """(n, units, block_bytes) uint8: each (group, unit)'s parts' bytes, in order."""
        n, u = self.groups, self.value.shape[1]
        return torch.cat([p.reshape(n, u, -1).contiguous().view(torch.uint8) for p in self.parts], dim=2)

    def from_blocks(self, raw: torch.Tensor) -> "KiviGroups":
        """Inverse of to_blocks for (n, units, block_bytes) uint8, in this storage's layout."""
        n, parts, offset = raw.shape[0], [], 0
        for p in self.parts:
            nbytes = p[0, 0].numel() * p.element_size()
            chunk = raw[:, :, offset:offset + nbytes]
            offset += nbytes
            if p.dtype != torch.uint8:  # an aligned copy: byte slices cannot be viewed as floats
                chunk = chunk.clone(memory_format=torch.contiguous_format).view(p.dtype)
            parts.append(chunk.reshape(n, *p.shape[1:]))
        G = self.group_size
        return KiviGroups(
            dataclasses.replace(self.key, data=parts[0], scale=parts[1], min=parts[2],
                                shape=(n * G, *self.key.shape[1:])),
            dataclasses.replace(self.value, data=parts[3], scale=parts[4], min=parts[5],
                                shape=(n, *self.value.shape[1:])))

    def dequantize_into(self, keys: torch.Tensor, values: torch.Tensor, scratch: Scratch | None = None) -> None:
        """Keys and values of every group into (units, n * G, d) views (e.g. of a reused
        buffer), group after group, each group's G positions in order."""
        dequantize_into(self.key, keys.transpose(0, 1), scratch)
        n, G = self.groups, self.group_size
        dequantize_into(self.value, values.unflatten(1, (n, G)).transpose(0, 1), scratch)


@dataclass(frozen=True, eq=False)
class KiviStored(TensorBundle):
    """What a KIVI cache tier returns: its complete groups, and the residual: (G, 2, units, d),
    the K and V of the last G positions written in full precision."""

    groups: KiviGroups
    residual: torch.Tensor

    @property
    def positions(self) -> int:
        """Positions it unpacks to: every group's, then the residual's rows."""
        return (self.groups.groups + 1) * self.groups.group_size

    @property
    def units(self) -> int:
        return self.residual.shape[2]

    @staticmethod
    def side_by_side(reads: list["KiviStored"]) -> "KiviStored":
        """Reads of the same positions (and layout) as one, their units one after another: a
        copy of every part (a single read is returned as it is)."""
        if len(reads) == 1:
            return reads[0]
        key, value = (_units_side_by_side([getattr(r.groups, name) for r in reads]) for name in ("key", "value"))
        return KiviStored(KiviGroups(key, value), torch.cat([r.residual for r in reads], dim=2))

    def dequantize_into(self, keys: torch.Tensor, values: torch.Tensor, scratch: Scratch | None = None) -> None:
        """Keys and values into (units, positions, d) views: the groups', then the residual's."""
        n = self.groups.groups * self.groups.group_size
        self.groups.dequantize_into(keys[:, :n], values[:, :n], scratch)
        keys[:, n:].copy_(self.residual[:, 0].transpose(0, 1), non_blocking=True)
        values[:, n:].copy_(self.residual[:, 1].transpose(0, 1), non_blocking=True)


def _units_side_by_side(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """QuantizedTensors alike but for dim 1 (the units, in a KIVI cache's keys and values, and in
    their codes, scales and minimums) joined along it."""
    shape = list(parts[0].shape)
    shape[1] = sum(p.shape[1] for p in parts)
    return dataclasses.replace(parts[0], shape=tuple(shape),
                               **{name: torch.cat([getattr(p, name) for p in parts], dim=1)
                                  for name in ("data", "scale", "min")})


def quantize_groups(k: torch.Tensor, v: torch.Tensor, cfg: Compression) -> KiviGroups:
    """k, v: (n * G, units, d), each unit's n groups of G consecutive positions in order."""
    G, d = cfg.group_size, k.shape[-1]
    if k.shape[0] % G:
        raise ValueError(f"quantize_groups takes whole groups of {G} positions, got {k.shape[0]}")
    n = k.shape[0] // G
    return KiviGroups(quantize(k, _key_cfg(cfg), 0),
                      quantize(v.unflatten(0, (n, G)).transpose(1, 2), _value_cfg(cfg, d), 3))


def rounded_groups(k: torch.Tensor, v: torch.Tensor, cfg: Compression) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: (n * G, units, d), each unit's n groups of G consecutive positions in order ->
    the values those groups dequantize to (quantize_groups, then KiviGroups.dequantize_into
    in k's dtype), bit for bit, without packing codes: what a KIVI cache held dense holds
    (executor/kv_cache.py)."""
    if k.shape[0] % cfg.group_size:
        raise ValueError(f"rounded_groups takes whole groups of {cfg.group_size} positions, got {k.shape[0]}")
    return fake_quantize(k, _key_cfg(cfg), 0), fake_quantize(v, _value_cfg(cfg, k.shape[-1]), 2)


def kivi_nbytes(positions: int, units: int, head_dim: int, dtype: torch.dtype, cfg: Compression) -> int:
    """Bytes of a KIVI cache of `positions` x `units`: the groups that hold them, and the
    residual (G positions of K and V in full precision)."""
    G = cfg.group_size
    groups = kivi_groups_nbytes(-(-positions // G), units, head_dim, dtype, cfg)
    return groups + 2 * G * units * head_dim * torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=4096)  # a policy search counts the same groups many times
def kivi_groups_nbytes(groups: int, units: int, head_dim: int, dtype: torch.dtype, cfg: Compression) -> int:
    """Bytes of `groups` complete groups of `units` units (KiviGroups)."""
    return KiviGroups.zeros(groups, units, head_dim, dtype, cfg, device="meta").nbytes


def as_stored(k: torch.Tensor, v: torch.Tensor, cfg: Compression, starts: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: (units, t, d), a left-padded batch whose unit u starts at position starts[u].
    Every key and value as a KIVI cache returns it once its group is complete (quantized,
    then dequantized to `dtype`), in place; the padding's as it was. A position's last,
    unfinished group comes back quantized too, from whatever fills it up: the caller takes
    those positions fresh, as the residual gives them."""
    u, t, d = k.shape
    G = cfg.group_size
    n = -(-t // G)
    rows = torch.arange(n * G, device=k.device)
    real = (rows[None, :] + starts.to(k.device)[:, None]).clamp_(max=t - 1)  # (u, n*G): cache row of real row
    kq = dequantize(quantize(k.gather(1, real[..., None].expand(-1, -1, d)).transpose(0, 1), _key_cfg(cfg), 0),
                    dtype).transpose(0, 1)
    vq = dequantize(quantize(v, _value_cfg(cfg, d), 2), dtype)
    back = (torch.arange(t, device=k.device)[None, :] - starts.to(k.device)[:, None])  # real row of cache row
    k_out = torch.where((back >= 0)[..., None], kq.gather(1, back.clamp(min=0)[..., None].expand(-1, -1, d)), k)
    return k_out.to(dtype), torch.where((back >= 0)[..., None], vq, v).to(dtype)
