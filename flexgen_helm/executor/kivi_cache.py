"""The KV cache of one (layer, GPU batch) under KIVI grouping (compression/kivi.py): keys
quantized per channel over groups of G tokens of a sequence, values per token, and each
unit's unfinished group kept in full precision. Split by units over the tiers, with the
writes and reads of KVCacheSlot.

Each tier holds, for its units:
- `groups`: the last `held` complete groups of each unit (KiviGroups), group g in slot
  g % held: every group of a run, or for a sliding-window block a ring of the groups its
  window reaches (ceil(window / G) slots).
- `residual`: (G, 2, units, d), K and V in full precision of the last G positions written,
  position p in row p % G. A unit's unfinished group (fewer than G positions) is always
  among them, so a decode step writes one row for all units, whatever their padding.
When a unit's count of real positions reaches a multiple of G, its last G positions are
quantized as one group and written to their slot. Groups count from each unit's first real
position (`starts`: the padding before it), so no number depends on the batch it shares.

A block whose prompts start with a shared prefix of P tokens may hold out every unit's
first `held_out_groups` groups (P // G: every row's are the prefix's tokens, the same keys
and values, quantized alike): decode attends to the block's one copy of them
(held_prefix.HeldPrefix), so group g of a unit is its (g - held_out_groups)-th held group,
and a write drops the groups held out. The prefix's last, partial group fills up with the
row's own tokens: it is the row's own, as is everything after it.

On disk: `held` rows of (units, block) bytes, one block per (group, unit) (a unit's new
group is one write, the groups [0, n) of all units one read), then the residual's G rows.

Reads return the groups held and the residual, as stored; `unpack` dequantizes them where
attention runs, and `decode_valid` says which of those positions a decode step may attend
to. They are not put back in sequence order: a decode step's attention does not depend on
the order of its keys.

Once some sequences finish, the gpu and cpu tiers write only the units still computed: a
finished sequence's groups and residual rows are left as they were, never read again (on
disk, whose residual rows are written whole, as zeros). A cache held dense
(Policy.keep_dense_cache) is no KiviCacheSlot: a kv_cache.KVCacheSlot rounds each group in
place once it completes."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from flexgen_helm.compression.kivi import KiviGroups, KiviStored, kivi_nbytes, quantize_groups
from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.executor.kv_cache import all_units, cache_rows, ring_runs, select_units, unit_ranges
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.disk_buffer import DiskBuffer
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy.policy import TIERS, Compression


class KiviCacheSlot:
    # the values of a group lie beside its keys, in one block: sparse attention reads them too
    values_apart = False

    def __init__(self, units: dict[str, int], max_len: int, head_dim: int, devices: Devices, usage: TierUsage,
                 disk_path: Path | None, pin: bool, compression: Compression, window: int, starts: torch.Tensor,
                 held_out_groups: int = 0):
        if len(starts) != sum(units.values()):
            raise ValueError(f"{len(starts)} unit starts for {sum(units.values())} units")
        if held_out_groups and (window or held_out_groups * compression.group_size > max_len):
            raise ValueError(f"a slot holds out groups within its {max_len} positions, not in a sliding window: "
                             f"got {held_out_groups} groups of {compression.group_size} (window {window})")
        self.units, self.ranges = units, unit_ranges(units)
        self.head_dim, self.devices, self.usage, self.cfg = head_dim, devices, usage, compression
        self.G = compression.group_size
        self.held_out_groups = held_out_groups
        self.held = -(-cache_rows(max_len, window) // self.G) - held_out_groups  # group slots per unit
        self.starts = starts.to("cpu", torch.long)
        # what a decode step asks of the starts, in integers (tensor ops cost more than the answer
        # at one position a step): a tier's units' starts, the earliest, and the earliest per
        # start modulo G (a position completes some unit's group only at those residues)
        self._tier_starts = {tier: tuple(self.starts[a:b].tolist()) for tier, (a, b) in self.ranges.items()}
        self._earliest_start = {tier: min(st, default=0) for tier, st in self._tier_starts.items()}
        self._earliest_start_by_residue = {
            tier: _earliest_start_by_residue(st, self.G) for tier, st in self._tier_starts.items()}
        self._views: dict[tuple[str, int], KiviGroups] = {}  # first(n) of a tier's groups, by (tier, n)
        self.groups: dict[str, KiviGroups] = {}
        self.residual: dict[str, torch.Tensor] = {}
        self.disk: DiskBuffer | None = None
        self.disk_bytes_read = 0
        dtype = devices.dtype
        for tier in ("gpu", "cpu"):
            if units[tier]:
                device, pinned = devices.tier_device(tier), tier == "cpu" and pin and devices.is_cuda
                self.groups[tier] = KiviGroups.zeros(self.held, units[tier], head_dim, dtype, compression, device,
                                                     pinned)
                self.residual[tier] = torch.zeros(self.G, 2, units[tier], head_dim, dtype=dtype, device=device,
                                                  pin_memory=pinned)
                usage.add(tier, self.groups[tier].nbytes + self.residual[tier].nbytes)
        # the layout of one group slot of the disk units, on the meta device
        self._disk_row = KiviGroups.zeros(1, units["disk"], head_dim, dtype, compression, "meta")
        self._block = self._disk_row.nbytes // max(1, units["disk"])
        self._residual_row = 2 * units["disk"] * head_dim * torch.empty((), dtype=dtype).element_size()
        self._residual_at = self.held * self._disk_row.nbytes
        if units["disk"]:
            nbytes = self._residual_at + self.G * self._residual_row
            assert nbytes == kivi_nbytes(cache_rows(max_len, window) - held_out_groups * self.G, units["disk"],
                                         head_dim, dtype, compression)
            self.disk = DiskBuffer(disk_path, nbytes)
            usage.add("disk", nbytes)

    def ignores_writes_to(self, a: int, b: int) -> bool:
        """A KIVI slot quantizes each row's groups from all the positions written
        (KVCacheSlot.ignores_writes_to): none may be left unmade."""
        return False

    def in_place(self, tier: str, device: torch.device) -> bool:
        """Never: attention reads a dequantized copy."""
        return False

    # ---- writes ----------------------------------------------------------------------------

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int, units: torch.Tensor | None = None,
              tiers: tuple[str, ...] = TIERS) -> None:
        """Store k, v of shape (s, units, d) at positions [start, start + s) of `tiers`: the
        groups they complete, and the last G of them in the residual. units: the (sorted)
        units k and v hold when not all (finished sequences left the batch): on the gpu and
        cpu tiers only theirs are written, on disk, whose residual rows are written whole,
        the others' as zeros (a finished sequence's cache is never read again)."""
        total = sum(self.units.values())
        units = None if units is None else units.cpu()
        for tier in tiers:
            a, b = self.ranges[tier]
            if a == b:
                continue
            mine = None  # the tier's units written: all of them
            if units is None:
                kt, vt = k[:, a:b], v[:, a:b]
            elif tier == "disk":
                kt, vt = all_units(k, units, total)[:, a:b], all_units(v, units, total)[:, a:b]
            else:
                here = ((units >= a) & (units < b)).nonzero().squeeze(1)  # on the host: no sync
                if not len(here):
                    continue
                at = here.to(k.device, non_blocking=True)
                kt, vt, mine = k.index_select(1, at), v.index_select(1, at), units[here] - a
            starts = self.starts[a:b] if mine is None else self.starts[a:b][mine]
            self._write_groups(tier, kt, vt, start, starts, mine)
            self._write_residual(tier, kt, vt, start, mine)

    def _write_groups(self, tier: str, k: torch.Tensor, v: torch.Tensor, start: int, starts: torch.Tensor,
                      mine: torch.Tensor | None = None) -> None:
        """Quantize and store the groups that positions [start, start + s) complete (a unit's
        last `held` of them, none held out), taking their earlier positions from the residual.
        mine: the tier's units k and v hold (None: all)."""
        G, s = self.G, k.shape[0]
        if s == 1 and not self._completes_group(tier, start):
            return
        done = (start + s - starts).clamp(min=0) // G  # complete groups of each unit after the write
        first = torch.maximum((start - starts).clamp(min=0) // G, done - self.held)  # the first one it completes
        first = first.clamp(min=self.held_out_groups)
        count = (done - first).clamp(min=0)
        if not bool(count.any()):
            return
        # positions [start - G + 1, start + s) hold every completed group (at most G - 1 came before)
        since = max(0, start - G + 1)
        recent_k, recent_v = k, v
        if since < start:
            earlier = self._residual_rows(tier, since, start, mine).to(k.device)
            recent_k, recent_v = torch.cat([earlier[:, 0], k]), torch.cat([earlier[:, 1], v])
        m = int(count.max())
        row = torch.arange(m * G)
        group = first[None, :] + (row // G)[:, None]  # (m * G, units): the group of each row of each unit
        index = (starts[None, :] + group * G + (row % G)[:, None] - since).clamp_(0, recent_k.shape[0] - 1)
        # (row, unit) pairs: indexing both dims measured ~3x faster than a gather over an index
        # expanded along head_dim
        index, unit_of = index.to(k.device), torch.arange(len(starts), device=k.device)
        new = quantize_groups(recent_k[index, unit_of], recent_v[index, unit_of], self.cfg)
        i = torch.arange(m)[:, None].expand(m, len(starts))
        keep = i < count[None, :]
        picked, unit = i[keep], torch.arange(len(starts))[None, :].expand(m, -1)[keep]
        slot = (first[unit] + picked - self.held_out_groups) % self.held
        if tier != "disk":
            self.groups[tier].put(slot, unit, new, picked, unit if mine is None else mine[unit])
            return
        blocks = new.to("cpu").to_blocks()[picked, unit]  # (pairs, block)
        order = torch.argsort(slot * len(starts) + unit)
        slot, unit, blocks = slot[order].tolist(), unit[order].tolist(), blocks[order]
        a = 0
        for b in range(1, len(slot) + 1):  # runs of neighbouring units in one slot: one write each
            if b == len(slot) or slot[b] != slot[a] or unit[b] != unit[b - 1] + 1:
                self.disk.write(slot[a] * self._disk_row.nbytes + unit[a] * self._block, blocks[a:b])
                a = b

    def _completes_group(self, tier: str, position: int) -> bool:
        """Whether writing `position` completes a group of some unit of the tier: position + 1
        is G or more real positions of a unit, and a multiple of G of them."""
        earliest = self._earliest_start_by_residue[tier].get((position + 1) % self.G)
        return earliest is not None and position + 1 - earliest >= self.G

    def _write_residual(self, tier: str, k: torch.Tensor, v: torch.Tensor, start: int,
                        mine: torch.Tensor | None = None) -> None:
        G = self.G
        n = min(k.shape[0], G)
        kv = torch.stack([k[-n:], v[-n:]], dim=1)  # (n, 2, units, d)
        first = start + k.shape[0] - n
        for row, a, count in ring_runs(first, n, G):
            if tier == "disk":
                self.disk.write(self._residual_at + row * self._residual_row, kv[a:a + count])
                continue
            if mine is None:
                self.residual[tier][row:row + count].copy_(kv[a:a + count], non_blocking=True)
            else:  # (a cpu tier's residual is host memory; kv is where it was computed)
                rows = self.residual[tier][row:row + count]
                rows.index_copy_(2, mine.to(rows.device, non_blocking=True), kv[a:a + count].to(rows.device))

    def _residual_rows(self, tier: str, first: int, end: int, mine: torch.Tensor | None = None) -> torch.Tensor:
        """The residual's rows of positions [first, end) (at most G, still held), in order, of
        the tier's units `mine` (None: all)."""
        rows = self._residual(tier)[torch.arange(first, end) % self.G]
        return rows if mine is None else rows.index_select(2, mine.to(rows.device, non_blocking=True))

    def _residual(self, tier: str) -> torch.Tensor:
        if tier != "disk":
            return self.residual[tier]
        raw = self.disk.read(self._residual_at, (self.G * self._residual_row,), torch.uint8)
        self.disk_bytes_read += raw.numel()
        return raw.view(self.devices.dtype).view(self.G, 2, self.units["disk"], self.head_dim)

    # ---- reads -------------------------------------------------------------------------------

    def _groups_read(self, tier: str, length: int) -> int:
        """Group slots a read at `length` returns: those some unit of the tier has filled."""
        done = max(0, length - self._earliest_start[tier]) // self.G
        return min(self.held, max(0, done - self.held_out_groups))

    def reads_in_place(self, tier: str, device: torch.device) -> bool:
        """Never: attention reads a KIVI cache dequantized (KVCacheSlot.reads_in_place)."""
        return False

    def read(self, tier: str, length: int, values: bool = True, room: bool = False) -> KiviStored:
        """The groups held by the tier's units and the residual, as stored, where they live
        (disk: into CPU memory). Values come with the keys whatever `values` says: they share
        blocks. (No room for a new token: unpack() makes it, reads_in_place is False.)"""
        if room:
            raise ValueError("a KIVI cache is read compressed and unpacked: it leaves no room for the new token")
        n = self._groups_read(tier, length)
        if tier != "disk":
            if (tier, n) not in self._views:  # views of the storage: still current when it is written
                self._views[tier, n] = self.groups[tier].first(n)
            return KiviStored(self._views[tier, n], self.residual[tier])
        raw = self.disk.read(0, (n, self.units["disk"], self._block), torch.uint8)
        self.disk_bytes_read += raw.numel()
        return KiviStored(self._disk_row.from_blocks(raw), self._residual("disk"))

    def unpack(self, tier: str, stored: KiviStored, device: torch.device, dtype: torch.dtype,
               buffers: CacheBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """What read(tier) returned, made ready for attention on `device`: keys and values
        (units, n + 1, d) of `dtype` in `buffers`, the n positions of the groups and the
        residual, then a column left for the new token."""
        return self.unpack_batches(tier, [stored], device, dtype, [buffers])[0]

    def unpack_batches(self, tier: str, stored: list[KiviStored], device: torch.device, dtype: torch.dtype,
                       buffers: list[CacheBuffers]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """unpack() of several GPU batches' reads of this layer's tier (what their slots' read
        returned), all in the first batch's buffers: the reads of the same positions (a block's
        batches share its columns, so most do) in one call, their units side by side, each
        batch then given its units' rows. A small batch's unpack is ~30 torch ops whatever its
        size (2-3 sequences: ~0.1 M values), which each batch unpacked alone paid again. The
        buffers are asked for as one piece for the whole load, so how the batches happen to
        group at a step does not make them grow."""
        d, out = self.head_dim, [None] * len(stored)
        alike: dict[int, list[int]] = {}
        for i, x in enumerate(stored):
            alike.setdefault(x.positions, []).append(i)
        most = sum(x.units for x in stored) * (max(alike) + 1) * d
        # keys as (units, d, positions), as a group's keys dequantize (each channel's G tokens
        # in a row) and as attention multiplies them (q @ k^T): no transposing copy
        key_room = buffers[0].take(f"keys-{tier}", (most,), dtype, device)
        value_room = buffers[0].take(f"values-{tier}", (most,), dtype, device)
        at = 0
        for n, batches in alike.items():
            # moved first, then joined where they compute: a pinned read copies without blocking
            together = KiviStored.side_by_side([stored[i].to(device, non_blocking=True) for i in batches])
            size = together.units * (n + 1) * d
            keys = key_room[at:at + size].view(together.units, d, n + 1).transpose(1, 2)
            values = value_room[at:at + size].view(together.units, n + 1, d)
            at += size
            together.dequantize_into(keys[:, :n], values[:, :n], buffers[0].scratch(device))
            first = 0
            for i in batches:
                out[i] = keys[first:first + stored[i].units], values[first:first + stored[i].units]
                first += stored[i].units
        return out

    def computed_rows(self, tier: str, keys: torch.Tensor, values: torch.Tensor | None, local: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Of a tier's loaded keys and values (unpack()'s: units, n + 1, d), those of its
        computed units (`local`, None: all): a copy of theirs."""
        return select_units(keys, local), select_units(values, local)

    def decode_valid(self, tier: str, length: int, window: int, key_valid: torch.Tensor,
                     local: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        """Which of unpack()'s n + 1 columns a decode step at `length` may attend to, for the
        computed units of the tier (`local`, None: all): a unit's own complete groups and its
        unfinished positions in the residual, within a sliding window's last `window`
        positions, and the new token. (No column is dropped; key_valid is not needed: a unit's
        padding is never stored; nor are the groups held out.) The same for every layer of a
        GPU batch, so a step computes it once (read-only: the layers share it)."""
        a, b = self.ranges[tier]
        starts = self._tier_starts[tier] if local is None else tuple(self.starts[a:b][local.cpu()].tolist())
        valid = _decode_valid(starts, length, window, self.G, self.held,
                              self._groups_read(tier, length), self.held_out_groups)
        return 0, valid.to(key_valid.device)

    def outside_prefix(self, valid: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
        """Of decode_valid's columns, those each unit may see outside the part of the block's
        shared prefix that decode attends to apart (its complete groups): all it holds, since
        those are the groups held out."""
        return valid

    def close(self) -> None:
        for tier in self.groups:
            self.usage.remove(tier, self.groups[tier].nbytes + self.residual[tier].nbytes)
        self.groups.clear()
        self.residual.clear()
        self._views.clear()
        if self.disk is not None:
            self.usage.remove("disk", self.disk.nbytes)
            self.disk.close()


def _earliest_start_by_residue(starts: list[int], G: int) -> dict[int, int]:
    """For each start modulo G, the earliest of the units' starts with it."""
    out: dict[int, int] = {}
    for st in starts:
        out[st % G] = min(st, out.get(st % G, st))
    return out


@functools.lru_cache(maxsize=256)  # a step of up to 256 GPU batches reuses its masks across layers
def _decode_valid(starts: tuple[int, ...], length: int, window: int, G: int, held: int,
                  n_groups: int, held_out_groups: int) -> torch.Tensor:
    """KiviCacheSlot.decode_valid's mask for units starting at `starts` (their left padding)."""
    starts = torch.tensor(starts, dtype=torch.long)
    have = length - starts  # real positions held; the new token is real position `have`
    done = have.clamp(min=0) // G
    # group slot j holds the unit's latest complete group g with (g - held_out_groups) % held == j
    slot = torch.arange(n_groups)
    kept = (done - held_out_groups).clamp(min=0)  # complete groups the slot keeps
    filled = kept[:, None] > slot[None, :]
    group = held_out_groups + slot[None, :] + held * ((kept[:, None] - 1 - slot[None, :]).div(
        held, rounding_mode="floor"))
    pos = group[..., None] * G + torch.arange(G)  # (units, slots, G) real positions
    in_groups = filled[..., None].expand_as(pos)
    # residual row r holds the latest position q < length with q % G == r
    q = length - 1 - (length - 1 - torch.arange(G)) % G
    res_pos = q[None, :] - starts[:, None]
    in_residual = res_pos >= done[:, None] * G  # not in a complete group yet (so >= 0, real)
    if window:
        in_groups = in_groups & (pos > have[:, None, None] - window)
        in_residual = in_residual & (res_pos > have[:, None] - window)
    new = torch.ones(len(starts), 1, dtype=torch.bool)
    return torch.cat([in_groups.flatten(1), in_residual, new], dim=1)
