"""The KV cache of one (layer, GPU batch), split by units over the tiers.

Every tier keeps the sequence-major layout (max_len, units, head_dim), so the cache of
positions [0, t) is one contiguous range (one disk read) and a decode step appends one
contiguous row (one disk write).

Under per-token cache compression each tier holds the QuantizedTensor form of that layout,
groups along head_dim (cache_group_dim): a position's row of one unit is quantized on its
own, so each new token is quantized once as it is written and never touches earlier groups.
(KIVI grouping, keys per channel over blocks of tokens, is kivi_cache.KiviCacheSlot.) A
compressed cache held dense (Policy.keep_dense_cache) is stored here uncompressed, its values
rounded as the compressed cache would return them: per token as each is written; under KIVI
each unit's group in place once its G positions are written (_round_completed_groups). On
disk a position's row is the bytes of its packed codes, then scales, then mins (of all the
tier's units), so [0, t) stays one read. Reads return what is stored; `unpack` moves it to
where attention runs and dequantizes it there, into buffers reused from step to step.

A sliding-window block (window w) keeps only its last w positions: its slot has w rows
(cache_rows) used as a ring, position p in row p % w, and reads return the positions
held oldest first, so the cache of a local block never grows past its window.

A block whose GPU batch shares a prompt prefix may hold out the positions [a, b) that every
row's copy of the prefix covers (`held_out`): decode attention reads those from the one copy
of the block's prefix (attention.DecodePrefix; under cache compression or sparse attention
held_prefix.HeldPrefix, which stores it as the slots would: a per-token group is one
position's row, so the prefix quantized once is every row's copy), so the slot keeps the
other positions only, position p in row p below a and p - (b - a) from b on, and writes of
held-out positions are dropped. Reads and decode_valid then speak of the held positions, in
order. (A KIVI slot holds out the prefix's complete groups instead: kivi_cache.py.)

A tier that attention reads in place packs its computed units to its front once sequences
finish (append_in_place): a finished sequence never computes again in its block, so its
units' rows are dead, and the live ones moved together once, when the set shrinks, are a
view for every later step, where gathered every step they were copied at each one
(runs/bench/packed_units). Such a tier is then read by append_in_place alone (never by
read()), and written by it, or, in a slot that rounds its writes, by the step's rewrite of
its one position (rounded per token, at every step; under KIVI only at a step that completes
some unit's group, which it rounds: rewrites_in_place), which puts them in the packed
columns: _rewrite_packed per token (only the computed units' rows, rounded and copied), or
_write_rows and _held_at (KIVI, and a step whose tiers are not all packed)."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from pathlib import Path

import torch

from flexgen_helm.compression.kivi import kivi_groups_nbytes, kivi_nbytes, rounded_groups
from flexgen_helm.compression.quantize import CACHE_GROUP_DIM, QuantizedTensor, cache_group_dim, fake_quantize
from flexgen_helm.compression.stored import Stored, dense_into, encode, stored_nbytes
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.direct_io import ALIGN
from flexgen_helm.memory.disk_buffer import DiskBuffer
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.policy.policy import TIERS, Compression, Policy


def check_cache_compression(cfg: Compression | None) -> None:
    """Per-token groups lie within a position's row, along head_dim, so that a token can be
    appended at a time; KIVI's keys run along the tokens and its values along head_dim,
    whatever a group dim says."""
    if cfg is None:
        return
    if cfg.kivi and cfg.group_dim is not None:
        raise PolicyError(f"the KIVI cache groups keys along the tokens and values along the head dim, not along "
                          f"dim {cfg.group_dim}: leave the cache's group dim unset (or use per-token grouping)")
    if cache_group_dim(cfg) not in (CACHE_GROUP_DIM, CACHE_GROUP_DIM - 3):
        raise PolicyError(f"the KV cache is quantized along the head dim (group dim {CACHE_GROUP_DIM}), "
                          f"not dim {cfg.group_dim}: leave the cache's group dim unset")


def cache_rows(max_len: int, window: int, held_out: tuple[int, int] | None = None, least: int = 0) -> int:
    """Positions a block's slot holds: all of a run's but those held out (module doc), or a
    sliding window's last `window`, and at least `least` of them (rounded_group_rows)."""
    if window:
        return min(max_len, max(window, least))
    return max_len - (held_out[1] - held_out[0] if held_out else 0)


def rounded_group_rows(policy: Policy) -> int:
    """The positions a sliding window's ring keeps at least: a KIVI cache held dense rounds a
    group once its G positions are written, from all of them (G), else none (0)."""
    cfg = policy.compress_cache
    return cfg.group_size if policy.keep_dense_cache and cfg.kivi else 0


def prefix_held_once(policy: Policy) -> bool:
    """Whether a block's shared prompt prefix is held once under `policy`: its slots hold out
    the positions every row's copy covers and decode attends to the one copy. Every row's
    copy of the prefix is the same keys and values at the same offset from its first real
    token, so it is stored alike in every row under any cache compression (held_prefix_len
    says how much of it), and sparse attention's top-k can rank the one copy's keys with each
    row's own (attention.attend_past_held_prefix)."""
    return policy.prefix_sharing


def held_prefix_len(shared_prefix: int, cfg: Compression | None) -> int:
    """The positions of a `shared_prefix` that a block holds once: all of them, where each
    position is stored on its own (no compression, per-token groups); under KIVI the
    complete groups of G that each row's groups make of them (its first floor(P / G) * G):
    the last, partial group fills up with each row's own tokens."""
    if cfg is not None and cfg.kivi:
        return shared_prefix // cfg.group_size * cfg.group_size
    return shared_prefix


def held_out_prefix(shared_prefix: int, window: int, policy: Policy) -> tuple[int, int] | None:
    """What the planner counts a global block's slot to hold out, for prompts of equal length
    whose first `shared_prefix` tokens are the same (paddings that differ shrink it, but for
    KIVI's groups, which count from each row's first token)."""
    held = held_prefix_len(shared_prefix, policy.compress_cache)
    return (0, held) if held and not window and prefix_held_once(policy) else None


def held_prefix_nbytes(positions: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       cfg: Compression | None) -> int:
    """Bytes of a block's one copy of the `positions` it holds of its shared prefix (K and V
    of kv_heads units), stored as the slots store them: quantized as each position's row, or
    as KIVI's complete groups (no residual: it holds no unfinished group)."""
    if cfg is not None and cfg.kivi:
        return kivi_groups_nbytes(positions // cfg.group_size, kv_heads, head_dim, dtype, cfg)
    return kv_nbytes(positions, kv_heads, head_dim, dtype, cfg)


@functools.lru_cache(maxsize=4096)  # a policy search counts the same caches many times
def kv_nbytes(positions: int, units: int, head_dim: int, dtype: torch.dtype, cfg: Compression | None) -> int:
    """Bytes of K and V for `positions` x `units`, as a slot stores them (KIVI: the groups
    that hold them and the full-precision residual)."""
    if cfg is not None and cfg.kivi:
        return kivi_nbytes(positions, units, head_dim, dtype, cfg)
    return 2 * stored_nbytes((positions, units, head_dim), dtype, cfg, None if cfg is None else CACHE_GROUP_DIM)


def kv_nbytes_per_position(units: int, head_dim: int, dtype: torch.dtype, cfg: Compression | None) -> float:
    """Bytes of K and V that one more position adds (KIVI: a group's share; the residual is a
    fixed G positions per slot)."""
    if cfg is not None and cfg.kivi:
        G = cfg.group_size
        return (kv_nbytes(G, units, head_dim, dtype, cfg) - kv_nbytes(0, units, head_dim, dtype, cfg)) / G
    return kv_nbytes(1, units, head_dim, dtype, cfg)


def keys_outside_prefix(valid: torch.Tensor, starts: torch.Tensor, length: int,
                        held_out: tuple[int, int] | None = None) -> torch.Tensor:
    """Of the keys valid (units, columns) marks, those outside each unit's copy of a shared
    prefix, positions [starts[u], starts[u] + length), where column c holds position c, or
    c + (b - a) from a on where the positions held_out = [a, b) are left out."""
    positions = torch.arange(valid.shape[1], device=valid.device)[None, :]
    if held_out is not None:
        a, b = held_out
        positions = torch.where(positions >= a, positions + (b - a), positions)
    starts = starts.to(valid.device)[:, None]
    return valid & ((positions < starts) | (positions >= starts + length))


def ring_runs(start: int, n: int, rows: int) -> list[tuple[int, int, int]]:
    """(first row, first of the n positions, count) of each run of the rows of a ring of
    `rows` that positions [start, start + n) fill (n <= rows): one, or two where it wraps."""
    row = start % rows
    first = min(n, rows - row)
    return [(row, 0, first)] + ([(0, first, n - first)] if n > first else [])


def unit_ranges(units: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The cache units [a, b) each tier holds: the tiers' counts, in tier order."""
    ranges, start = {}, 0
    for tier in TIERS:
        ranges[tier] = (start, start + units[tier])
        start += units[tier]
    return ranges


def all_units(x: torch.Tensor, units: torch.Tensor, total: int) -> torch.Tensor:
    """x (s, len(units), d) of the (sorted) `units` as (s, total, d): the others' rows zero.
    units: on the CPU (StepRows.unit_index), copied to x's device without waiting for it."""
    full = x.new_zeros(x.shape[0], total, x.shape[2])
    full[:, units.to(x.device, non_blocking=True)] = x
    return full


def select_units(x: torch.Tensor | None, local: torch.Tensor | None) -> torch.Tensor | None:
    """x's units (dim 0) `local` (None: x itself), a copy of theirs."""
    return x if x is None or local is None else x.index_select(0, local.to(x.device))


def packing_moves(packed: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor | None:
    """Where the units `local` (sorted, on the CPU) are among those a tier holds in front
    (`packed`; None: all its units, in order), to move them to its front in order; None where
    they are there already. A unit not among them is an error: a finished sequence never
    computes again in its block."""
    if packed is not None and (packed is local or torch.equal(packed, local)):
        return None
    at = local if packed is None else torch.searchsorted(packed, local)
    if packed is not None and not torch.equal(packed[at.clamp(max=len(packed) - 1)], local):
        raise AssertionError(f"units {local.tolist()} are not all among those packed before, {packed.tolist()}")
    return None if torch.equal(at, torch.arange(len(local))) else at


def _parts(x: Stored) -> tuple[torch.Tensor, ...]:
    return x.parts if isinstance(x, QuantizedTensor) else (x,)


class KVCacheSlot:
    def __init__(self, units: dict[str, int], max_len: int, head_dim: int, devices: Devices,
                 usage: TierUsage, disk_path: Path | None, pin: bool, compression: Compression | None = None,
                 window: int = 0, held_out: tuple[int, int] | None = None, rounding: Compression | None = None,
                 starts: torch.Tensor | None = None):
        """rounding: the compression whose values a dense slot (compression None) holds
        (Policy.keep_dense_cache): per token, each write rounded to its grid first; KIVI, each
        unit's group rounded once its G positions are written, counted from the unit's first
        real position, `starts` (its padding before it), as a KiviCacheSlot counts them."""
        if compression is not None and compression.kivi:
            raise ValueError("a KIVI-grouped cache is a KiviCacheSlot")
        if rounding is not None and compression is not None:
            raise ValueError("a slot rounds its writes only when it stores them dense")
        kivi = rounding is not None and rounding.kivi
        if kivi and (units["disk"] or starts is None or len(starts) != sum(units.values())):
            raise ValueError(f"a KIVI cache held dense rounds each group where it is held, in memory, from its units' "
                             f"starts: got units {units} and {None if starts is None else len(starts)} starts")
        if held_out is not None and (window or not 0 <= held_out[0] < held_out[1] <= max_len):
            raise ValueError(f"a slot holds out positions [a, b) within its {max_len}, not in a sliding window: "
                             f"got {held_out} (window {window})")
        self.units = units
        self.ranges = unit_ranges(units)
        self.max_len, self.head_dim, self.devices, self.usage = max_len, head_dim, devices, usage
        self.window, self.held_out = window, held_out
        self.rows = cache_rows(max_len, window, held_out, rounding.group_size if kivi else 0)
        self.compression, self.rounding = compression, rounding
        # KIVI held dense: each unit's first real position, and the earliest of them per
        # residue modulo G (a decode step's position completes some unit's group only at those)
        self._starts = starts.to("cpu", torch.long) if kivi else None
        self._earliest_by_residue: dict[int, int] = {}
        for st in (self._starts.tolist() if kivi else ()):
            r = st % rounding.group_size
            self._earliest_by_residue[r] = min(st, self._earliest_by_residue.get(r, st))
        self.k: dict[str, Stored] = {}
        self.v: dict[str, Stored] = {}
        # per in-place tier whose units were packed: the (sorted, tier-local) units now at its
        # front, in order (append_in_place); absent: every unit at its own place
        self._packed: dict[str, torch.Tensor] = {}
        self.disk: DiskBuffer | None = None
        self.disk_bytes_read = 0  # what decode attention read from the disk tier (sparse reads show here)
        for tier in ("gpu", "cpu"):
            if units[tier]:
                pinned = tier == "cpu" and pin and devices.is_cuda
                self.k[tier] = self._empty(self.rows, units[tier], devices.tier_device(tier), pinned)
                self.v[tier] = self._empty(self.rows, units[tier], devices.tier_device(tier), pinned)
                usage.add(tier, self.k[tier].nbytes + self.v[tier].nbytes)
        # One position's row of the disk units, on the meta device: the layout of a disk row.
        self._disk_row = self._empty(1, units["disk"], "meta", False)
        self._row_bytes = sum(p.nbytes for p in _parts(self._disk_row))
        self._disk_half = self.rows * self._row_bytes  # K rows, then V rows
        assert 2 * self._disk_half == self.disk_nbytes(units["disk"], max_len, head_dim, devices.dtype, compression,
                                                       window, held_out)
        if units["disk"]:
            self.disk = DiskBuffer(disk_path, 2 * self._disk_half)
            usage.add("disk", 2 * self._disk_half)

    def _empty(self, rows: int, units: int, device, pin: bool) -> Stored:
        shape, dtype = (rows, units, self.head_dim), self.devices.dtype
        if self.compression is None:
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        return QuantizedTensor.empty(shape, dtype, self.compression, CACHE_GROUP_DIM, device, pin)

    @staticmethod
    def disk_nbytes(disk_units: int, max_len: int, head_dim: int, dtype: torch.dtype,
                    compression: Compression | None, window: int = 0, held_out: tuple[int, int] | None = None) -> int:
        """The size of a slot's disk file (K and V of every position it holds), known before
        it is made."""
        return kv_nbytes(cache_rows(max_len, window, held_out), disk_units, head_dim, dtype, compression)

    # ---- writes ----------------------------------------------------------------------------

    def in_place(self, tier: str, device: torch.device) -> bool:
        """Whether attention on `device` can read this tier's cache where it lives, as a view
        in which a decode step writes its new position first (no copy of the cache per step).
        Not a sliding window's ring: its positions wrap, so [0, position] is no view of it."""
        return self.compression is None and tier != "disk" and bool(self.units[tier]) and \
            not self.window and self.k[tier].device == torch.device(device)

    def rewrites_in_place(self, position: int) -> bool:
        """Whether a decode step's `position`, written in place and attended to as computed
        (append_in_place), must be written again after the step (write): rounded, where the
        slot rounds its writes; under KIVI's rounding only at a step that completes some
        unit's group (the others' rows are already what the slot keeps: a copy saved per
        layer and step)."""
        if self.rounding is None:
            return False
        return self._starts is None or self._completes_group(position)

    @property
    def rounds_each_write(self) -> bool:
        """Whether every write is rounded to the per-token grid as a whole (not KIVI's groups
        of positions): a decode step's writes of several GPU batches may then be rounded in one
        call beforehand (write's `rounded`)."""
        return self.rounding is not None and self._starts is None

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int, units: torch.Tensor | None = None,
              tiers: tuple[str, ...] = TIERS, rounded: bool = False) -> None:
        """Store k, v of shape (s, units, d) at positions [start, start + s) of `tiers` (a
        ring holds only the last `rows` of them). units: the (sorted) units k and v hold when
        not all (finished sequences left the batch): the others' rows at these positions are
        written as zeros, never read. rounded: k and v are on the per-token grid already
        (rounds_each_write; the grid rounds each position and unit alone, so rounding them
        with other batches' gives the same bits)."""
        if units is not None and self._rewrites_packed(k.shape[0], tiers):
            self._rewrite_packed(k, v, start, units, tiers, rounded)
            return
        if units is not None:
            total = sum(self.units.values())
            k, v = all_units(k, units, total), all_units(v, units, total)
        written = (k, v, start)  # as given: a group completed now is rounded from all its positions
        if self.window and k.shape[0] > self.rows:
            start, k, v = start + k.shape[0] - self.rows, k[-self.rows:], v[-self.rows:]
        if self.rounds_each_write and not rounded:  # K and V in one call: groups never cross positions
            kv = fake_quantize(torch.cat([k, v]), self.rounding, CACHE_GROUP_DIM)
            k, v = kv.narrow(0, 0, k.shape[0]), kv.narrow(0, k.shape[0], v.shape[0])
        gd = None if self.compression is None else CACHE_GROUP_DIM
        if gd is not None and k.shape[0] == 1:
            # a decode step's one position: its K and V quantized in one call, whose fixed costs
            # are most of it (0.42 -> 0.22 ms a layer, SmolLM2's 30 units); the groups run along
            # the head dim, never across positions, so each comes out as quantized alone
            kv = encode(torch.cat([k, v]), self.compression, gd)
            k, v = kv.narrow(0, 0, 1), kv.narrow(0, 1, 1)
        else:
            k, v = encode(k, self.compression, gd), encode(v, self.compression, gd)  # quantized where computed
        for row, a, n in self._row_runs(start, k.shape[0]):
            self._write_rows(k.narrow(0, a, n), v.narrow(0, a, n), row, tiers)
        if self._starts is not None:
            self._round_completed_groups(*written, units)

    def ignores_writes_to(self, a: int, b: int) -> bool:
        """Whether a write's positions [a, b) are never read: the slot holds them out and
        stores what it holds as given (dense, not rounded), so they may be left unmade."""
        return (self.compression is None and self.rounding is None and not self.window and self.held_out is not None
                and self.held_out[0] <= a and b <= self.held_out[1])

    def _rewrites_packed(self, positions: int, tiers: tuple[str, ...]) -> bool:
        """Whether a write is a decode step's per-token rewrite of tiers whose computed units
        append_in_place packed to their front (each tier holding units): then it rounds and
        writes those units' rows alone (_rewrite_packed), with no scatter of them among all the
        units for _write_rows to pick them back out of (0.6-0.9x the general write's time at
        SmolLM2's shapes, a third of the units computing: runs/bench/pertoken_rewrite)."""
        return positions == 1 and self.rounding is not None and self._starts is None and \
            all(tier in self._packed for tier in tiers if self.ranges[tier][0] != self.ranges[tier][1])

    def _rewrite_packed(self, k: torch.Tensor, v: torch.Tensor, start: int, units: torch.Tensor,
                        tiers: tuple[str, ...], rounded: bool = False) -> None:
        """write() of one position's k, v ((1, len(units), d), the sorted computed `units`) on
        packed tiers (_rewrites_packed): rounded per token in one call, each tier's run of
        units copied to the front of its row, where append_in_place put them."""
        kv = torch.cat([k, v]) if rounded else fake_quantize(torch.cat([k, v]), self.rounding, CACHE_GROUP_DIM)
        row, computed = self._row(start), units.tolist()
        for tier in tiers:
            a, b = self.ranges[tier]
            if a == b:
                continue
            lo, hi = bisect.bisect_left(computed, a), bisect.bisect_left(computed, b)
            if not torch.equal(self._packed[tier], units[lo:hi] - a):  # never a silent write to other units' columns
                raise AssertionError(f"tier {tier} packed units {self._packed[tier].tolist()}, not the ones this "
                                     f"write computed, {(units[lo:hi] - a).tolist()}")
            self.k[tier][row, :hi - lo].copy_(kv[0, lo:hi], non_blocking=True)
            self.v[tier][row, :hi - lo].copy_(kv[1, lo:hi], non_blocking=True)

    def _round_completed_groups(self, k: torch.Tensor, v: torch.Tensor, start: int, units: torch.Tensor | None
                                ) -> None:
        """KIVI held dense, after a write of k, v ((s, all units, d)) at positions [start, start
        + s): the groups it completed rounded in place as they dequantize (kivi.rounded_groups),
        each unit's G positions taken from k, v (those written now) or from the slot (earlier
        ones), put back where the slot holds them. A unit's unfinished group stays as computed,
        as KIVI's residual keeps it. units: those computed (None: all); no other unit completes
        a group."""
        G, s, d = self.rounding.group_size, k.shape[0], k.shape[2]
        if s == 1 and not self._completes_group(start):
            return
        plan = self._group_plan(start, s, units)
        if plan is None:
            return
        if plan.taken is None:  # a prefill's: (rows picked by one index_select: ~4x faster than x[i, u])
            kg, vg = (_pick(x, plan.offsets, plan.units) for x in (k, v))
        else:
            kg, vg = (torch.empty(plan.pairs, d, dtype=k.dtype, device=k.device) for _ in range(2))
            for out, x in ((kg, k), (vg, v)):
                out[plan.taken.to(k.device)] = _pick(x, plan.offsets, plan.units)
            for tier, which, rows, cols in plan.read_from:
                for out, x in ((kg, self.k[tier]), (vg, self.v[tier])):
                    out[which.to(k.device)] = _pick(x, rows, cols).to(k.device)
        kr, vr = (x.view(plan.pairs, d) for x in rounded_groups(kg.view(G, -1, d), vg.view(G, -1, d), self.rounding))
        for tier, which, rows, cols in plan.write_to:
            for x, rounded in ((self.k[tier], kr), (self.v[tier], vr)):
                x.view(-1, d).index_copy_(0, (rows * x.shape[1] + cols),
                                          rounded[which.to(k.device)].to(x.device, x.dtype))

    def _group_plan(self, start: int, s: int, units: torch.Tensor | None) -> "GroupPlan | None":
        """Which (position, unit) pairs a write of positions [start, start + s) completes
        groups of, and where they come from and go (GroupPlan); None where it completes none.
        The same for every layer's slot of a GPU batch whose tiers, ring and packed units are
        alike, so it is worked out once and looked up by all of them (GROUP_PLANS): the index
        arithmetic was ~60% of a decode write that completes groups at LAMBADA's shapes."""
        key = (start, s, None if units is None else tuple(units.tolist()), tuple(self._starts.tolist()),
               self.rounding.group_size, self.window, self.rows, self.held_out,
               tuple(sorted(self.ranges.items())),
               tuple((t, tuple(p.tolist())) for t, p in sorted(self._packed.items())),
               tuple((t, str(x.device)) for t, x in sorted(self.k.items()) if x is not None))
        plan = GROUP_PLANS.get(key, _NO_PLAN)  # (one lookup: another engine's copy thread may clear them)
        if plan is _NO_PLAN:
            plan = self._worked_out_plan(start, s, units)
            if len(GROUP_PLANS) >= GROUP_PLANS_KEPT:
                GROUP_PLANS.clear()
            GROUP_PLANS[key] = plan
        return plan

    def _worked_out_plan(self, start: int, s: int, units: torch.Tensor | None) -> "GroupPlan | None":
        G = self.rounding.group_size
        ids = torch.arange(len(self._starts)) if units is None else units.cpu()
        starts = self._starts[ids]
        done = (start + s - starts).clamp(min=0) // G  # each unit's complete groups after the write
        first = (start - starts).clamp(min=0) // G  # ... and before it
        if self.window:  # a ring keeps positions [start + s - rows, start + s): older groups are gone
            first = torch.maximum(first, (start + s - self.rows - starts).clamp(min=0) // G)
        count = (done - first).clamp(min=0)
        if not bool(count.any()):
            return None
        i = torch.arange(int(count.max()))[:, None]
        keep = i < count[None, :]
        group_start = (starts[None, :] + (first[None, :] + i) * G)[keep]  # of each (unit, group) pair
        positions = (group_start[None, :] + torch.arange(G)[:, None]).reshape(-1)  # (G x pairs), flat
        unit = ids[None, :].expand_as(keep)[keep].expand(G, -1).reshape(-1)
        new = positions >= start
        write_to = self._held_at(positions, unit, self._holds(positions, start + s))
        if bool(new.all()):
            return GroupPlan(len(positions), positions - start, unit, None, [], write_to)
        taken = new.nonzero().squeeze(1)
        return GroupPlan(len(positions), positions[taken] - start, unit[taken], taken,
                         self._held_at(positions, unit, ~new), write_to)

    def _holds(self, positions: torch.Tensor, end: int) -> torch.Tensor:
        """Which of `positions` the slot holds once positions up to `end` are written: a ring
        its last `rows`; not those held out."""
        held = torch.ones_like(positions, dtype=torch.bool)
        if self.window:
            held &= positions >= end - self.rows
        if self.held_out is not None:
            held &= (positions < self.held_out[0]) | (positions >= self.held_out[1])
        return held

    def _completes_group(self, position: int) -> bool:
        """Whether writing `position` completes some unit's KIVI group: position + 1 is G or
        more real positions of a unit, and a multiple of G of them."""
        earliest = self._earliest_by_residue.get((position + 1) % self.rounding.group_size)
        return earliest is not None and position + 1 - earliest >= self.rounding.group_size

    def _held_at(self, positions: torch.Tensor, unit: torch.Tensor, mask: torch.Tensor
                 ) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Where the slot holds the (position, unit) pairs `mask` marks (held: _holds): per
        tier, their indices among the pairs, and their rows and columns there (its units
        packed to its front once some finished: _pack)."""
        out = []
        for tier in ("gpu", "cpu"):
            a, b = self.ranges[tier]
            which = (mask & (unit >= a) & (unit < b)).nonzero().squeeze(1)
            if a == b or not len(which):
                continue
            p, local = positions[which], unit[which] - a
            if self.window:
                rows = p % self.rows
            elif self.held_out is not None:
                lo, hi = self.held_out
                assert not bool(((p >= lo) & (p < hi)).any()), "a held-out position is not the slot's"
                rows = torch.where(p >= hi, p - (hi - lo), p)
            else:
                rows = p
            packed = self._packed.get(tier)
            cols = local if packed is None else torch.searchsorted(packed, local)
            device = self.k[tier].device
            out.append((tier, which, rows.to(device), cols.to(device)))
        return out

    def _row_runs(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """(first row, first of the n positions, count) of each run of rows that hold
        positions [start, start + n): a ring's, or those around the held-out positions."""
        if self.window:
            return ring_runs(start, n, self.rows)
        if self.held_out is None:
            return [(start, 0, n)]
        a, b = self.held_out
        runs = []
        if start < a:
            runs.append((start, 0, min(n, a - start)))
        if start + n > b:
            first = max(start, b)
            runs.append((first - (b - a), first - start, start + n - first))
        return [run for run in runs if run[2] > 0]

    def _row(self, position: int) -> int:
        """The row that holds `position` (one the slot holds)."""
        return self._row_runs(position, 1)[0][0]

    def _write_rows(self, k: Stored, v: Stored, row: int, tiers: tuple[str, ...]) -> None:
        for tier in tiers:
            a, b = self.ranges[tier]
            if a == b:
                continue
            kt, vt = k.narrow(1, a, b - a), v.narrow(1, a, b - a)
            packed = self._packed.get(tier)
            if packed is not None:  # a decode step's rewrite (append_in_place): its units in front
                assert self.rounding is not None and kt.shape[0] == 1, "a packed tier is written by its decode steps"
                at = packed.to(kt.device)
                kt, vt = kt.index_select(1, at), vt.index_select(1, at)
            if tier == "disk":
                self.disk.write(row * self._row_bytes, self._to_rows(kt))
                self.disk.write(self._disk_half + row * self._row_bytes, self._to_rows(vt))
            else:
                for dst, src in ((self.k[tier], kt), (self.v[tier], vt)):
                    for d, s in zip(_parts(dst), _parts(src)):
                        d[row:row + s.shape[0], :s.shape[1]].copy_(s, non_blocking=True)

    def append_in_place(self, tier: str, k: torch.Tensor, v: torch.Tensor, position: int,
                        local: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step on a tier that is in_place: write its new k, v ((n, 1, d), of the
        tier's units `local`, None: all of them) at `position` and return the keys and values
        of positions [0, position] of those units, (n, t, d): views of the cache (its
        computed units packed to its front where some finished: _pack). A slot that rounds
        its writes rewrites the position rounded after the step (write, into the packed
        columns): every step per token, under KIVI only a step that completes a group
        (rewrites_in_place)."""
        kt, vt = self.k[tier], self.v[tier]
        row = self._row(position)
        if local is None:
            assert tier not in self._packed, "every unit computes again after some finished"
            kt[row].copy_(k[:, 0])
            vt[row].copy_(v[:, 0])
            return kt[:row + 1].transpose(0, 1), vt[:row + 1].transpose(0, 1)
        n = len(local)
        self._pack(tier, local, row)
        kt[row, :n].copy_(k[:, 0])
        vt[row, :n].copy_(v[:, 0])
        return kt[:row + 1, :n].transpose(0, 1), vt[:row + 1, :n].transpose(0, 1)

    def _pack(self, tier: str, local: torch.Tensor, rows: int) -> None:
        """Moves the tier's units `local` (sorted; all of them computed at its last step, as a
        finished sequence never computes again) to its front, in order, with their rows [0,
        rows); nothing where they are there already."""
        local = local.cpu()
        at = packing_moves(self._packed.get(tier), local)
        if at is not None:
            at = at.to(self.k[tier].device)
            for t in (self.k[tier], self.v[tier]):
                t[:rows, :len(local)] = t[:rows].index_select(1, at)
        self._packed[tier] = local

    # ---- reads -------------------------------------------------------------------------------

    def computed_rows(self, tier: str, keys: torch.Tensor, values: torch.Tensor | None, local: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Of a tier's loaded keys and values (unpack()'s: units, n + 1, d; values None where
        left on disk), those of its computed units (`local`, None: all): a copy of theirs."""
        return select_units(keys, local), select_units(values, local)

    def first_held(self, length: int) -> int:
        """The oldest of positions [0, length) that the slot still holds (a ring forgets)."""
        return max(0, length - self.rows) if self.window else 0

    def reads_in_place(self, tier: str, device: torch.device) -> bool:
        """Whether attention on `device` reads this tier's cache where read() put it: a dense
        disk tier (no ring) attended on the CPU. Its read lands position-major, as the memory
        tiers hold theirs, with a row left for the new token, so unpack() hands out views
        where it copied the whole read (on OLMoE-1B-7B at a block of 32 with 68% of its cache
        on disk, converting to float32 as it copied: 397 ms of a 2.5 s decode step,
        runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_evening)."""
        return (tier == "disk" and self.compression is None and not self.window and bool(self.units[tier])
                and torch.device(device).type == "cpu")

    def read(self, tier: str, length: int, values: bool = True, room: bool = False) -> tuple[Stored, Stored | None]:
        """Positions [first_held(length), length) of a tier's units as stored, oldest first,
        where they live (disk: into CPU memory). values=False skips V (sparse attention
        reads only the rows it keeps). room (the disk tier of a slot that reads_in_place):
        one more row after them, for the new token's."""
        first = self.first_held(length)
        runs = []
        for r, _, n in self._row_runs(first, length - first):
            if runs and runs[-1][1] == r:  # around held-out positions: rows run on
                runs[-1] = (runs[-1][0], r + n)
            else:
                runs.append((r, r + n))
        if tier != "disk":
            assert tier not in self._packed, "a tier packed by append_in_place is read by it alone"
            return _runs_of(self.k[tier], runs), _runs_of(self.v[tier], runs) if values else None
        k = self._read_rows(0, runs, room)
        return k, self._read_rows(self._disk_half, runs, room) if values else None

    # a decode step's sparse attention may read the values of the disk tier apart from the
    # keys, only the rows it keeps (read_disk_values)
    values_apart = True

    def unpack(self, tier: str, stored: tuple[Stored, Stored | None], device: torch.device, dtype: torch.dtype,
               buffers: CacheBuffers) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What read(tier) returned, made ready for attention on `device`: keys and values
        (units, n + 1, d) of `dtype` in `buffers`, the n positions held oldest first, then a
        column left for the new token (None for values not read). A tier that reads_in_place
        is already that, in the cache's dtype: views of the read, as the memory tiers' are of
        their storage (append_in_place)."""
        if self.reads_in_place(tier, device):  # read with the new token's row: (n + 1, units, d)
            return tuple(None if x is None else x.transpose(0, 1) for x in stored)
        out = []
        for name, x in zip(("keys", "values"), stored):
            if x is None:
                out.append(None)
                continue
            n, u = x.shape[0], x.shape[1]
            buf = buffers.take(f"{name}-{tier}", (u, n + 1, self.head_dim), dtype, device)
            dense_into(x if isinstance(x, torch.Tensor) else x.to(device, non_blocking=True),
                       buf[:, :n].transpose(0, 1), buffers.scratch(device))
            out.append(buf)
        return out[0], out[1]

    def unpack_batches(self, tier: str, stored: list, device: torch.device, dtype: torch.dtype,
                       buffers: list) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """unpack() of several GPU batches' reads of this layer's tier, each into its own buffers."""
        return [self.unpack(tier, x, device, dtype, b) for x, b in zip(stored, buffers)]

    def decode_valid(self, tier: str, length: int, window: int, key_valid: torch.Tensor,
                     local: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        """For a decode step at `length` whose computed units of `tier` may see the keys
        key_valid ((units, length + 1): padding False): the columns of unpack()'s keys to drop
        (a sliding window's ring may hold one position more than the window takes), and which
        of the rest each unit may see."""
        first = self.first_held(length)
        drop = max(0, length - first + 1 - window) if window else 0
        if self.held_out is not None:
            a, b = self.held_out
            key_valid = torch.cat([key_valid[:, :a], key_valid[:, b:]], dim=1)
        return drop, key_valid[:, first + drop:]

    def outside_prefix(self, valid: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
        """Of decode_valid's columns (valid: (units, columns), a global block's), those each
        unit may see outside its copy of the block's shared prefix, positions [starts[u],
        starts[u] + length): decode attends to the prefix's one copy instead."""
        return keys_outside_prefix(valid, starts, length, self.held_out)

    def positions_of(self, first: int, columns: list[int]) -> list[int]:
        """The positions of `columns` of the positions held from position `first` on, in order
        (decode's keys: a read's, after the columns it drops): the held-out ones skipped."""
        if self.held_out is None:
            return [first + c for c in columns]
        a, b = self.held_out
        return [first + c + (b - a if first + c >= a else 0) for c in columns]

    def read_disk_values(self, positions: list[int]) -> Stored:
        """V of the disk units at the given distinct positions (still held), in that order,
        reading only the runs of rows that hold them (runs closer than a disk page are read
        as one)."""
        wanted = [self._row(p) for p in positions]
        gap = math.ceil(ALIGN / self._row_bytes)
        runs: list[list[int]] = []
        for p in sorted(wanted):
            if runs and p - runs[-1][1] <= gap:
                runs[-1][1] = p + 1
            else:
                runs.append([p, p + 1])
        rows = self._read_rows(self._disk_half, runs)
        if sum(b - a for a, b in runs) == len(wanted) and wanted == sorted(wanted):
            return rows
        keep = torch.cat([torch.arange(a, b) for a, b in runs])
        return _index_rows(rows, torch.searchsorted(keep, torch.tensor(wanted)))

    def _read_rows(self, base: int, runs, room: bool = False) -> Stored:
        """The rows of `runs` of one half (K at 0, V at _disk_half), one row more where `room`."""
        if len(runs) == 1:
            (a, b), = runs
            raw = self.disk.read(base + a * self._row_bytes, (b - a, self._row_bytes), torch.uint8, int(room))
            self.disk_bytes_read += (b - a) * self._row_bytes
            return self._from_rows(raw)
        pieces = [self.disk.read(base + a * self._row_bytes, (b - a, self._row_bytes), torch.uint8) for a, b in runs]
        self.disk_bytes_read += sum(r.numel() for r in pieces)
        n = sum(b - a for a, b in runs)
        raw = torch.empty(n + int(room), self._row_bytes, dtype=torch.uint8)
        torch.cat(pieces, out=raw[:n])
        return self._from_rows(raw)

    # ---- the disk row format -------------------------------------------------------------

    def _to_rows(self, x: Stored) -> torch.Tensor:
        """(s, units, d) as stored -> (s, row_bytes) uint8: each part's bytes, in order."""
        n = x.shape[0]
        return torch.cat([p.reshape(n, -1).view(torch.uint8) for p in _parts(x)], dim=1)

    def _from_rows(self, raw: torch.Tensor) -> Stored:
        """Inverse of _to_rows, for (n, row_bytes) uint8 read back from disk."""
        n, parts, offset = raw.shape[0], [], 0
        for p in _parts(self._disk_row):
            chunk = raw[:, offset:offset + p.nbytes]
            offset += p.nbytes
            if p.dtype != torch.uint8 and (not chunk.is_contiguous() or chunk.storage_offset() % p.element_size()):
                # a fresh, aligned copy: a slice of each row's bytes (of one row: at an offset
                # that is no multiple of a float's size) cannot be viewed as floats
                chunk = chunk.clone(memory_format=torch.contiguous_format)
            chunk = chunk.view(p.dtype)
            parts.append(chunk.reshape(n, *p.shape[1:]))
        if self.compression is None:
            return parts[0]
        return dataclasses.replace(self._disk_row, data=parts[0], scale=parts[1], min=parts[2],
                                   shape=(n, *self._disk_row.shape[1:]))

    def close(self) -> None:
        for tier in ("gpu", "cpu"):
            if self.units[tier]:
                self.usage.remove(tier, self.k[tier].nbytes + self.v[tier].nbytes)
        self.k.clear()
        self.v.clear()
        if self.disk is not None:
            self.usage.remove("disk", 2 * self._disk_half)
            self.disk.close()


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What a KIVI cache held dense rounds after a write (KVCacheSlot._group_plan): its `pairs`
    (position, unit) pairs, G a group, in order; offsets and units: those the write holds, their
    positions within it and their units (`taken`: which of the pairs they are; None: all);
    read_from: where the slot holds the others, and write_to: where the rounded pairs go, each
    (tier, which of the pairs, rows, columns)."""

    pairs: int
    offsets: torch.Tensor
    units: torch.Tensor
    taken: torch.Tensor | None
    read_from: list
    write_to: list


# KVCacheSlot._group_plan's plans, by everything they are worked out from; a write's key holds
# its start, so the few of one step are the ones looked up again (by the other layers' slots)
GROUP_PLANS: dict[tuple, GroupPlan | None] = {}
GROUP_PLANS_KEPT = 64
_NO_PLAN = object()


def _pick(x: torch.Tensor, i: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x[i, u] of x (s, units, d), as (len(i), d): one index_select of its rows where x is
    contiguous or a transposed contiguous (units, s, d) (what prefill attention's keys are)."""
    d = x.shape[2]
    if x.is_contiguous():
        return x.view(-1, d).index_select(0, (i * x.shape[1] + u).to(x.device))
    if x.transpose(0, 1).is_contiguous():
        return x.transpose(0, 1).reshape(-1, d).index_select(0, (u * x.shape[0] + i).to(x.device))
    return x[i.to(x.device), u.to(x.device)]


def _runs_of(x: Stored, runs: list[tuple[int, int]]) -> Stored:
    """Rows [a, b) of each run, in order: a view for one run, a copy where a ring wraps."""
    if len(runs) == 1:
        return x.narrow(0, runs[0][0], runs[0][1] - runs[0][0])
    return _index_rows(x, torch.cat([torch.arange(a, b) for a, b in runs]).to(x.device))


def _index_rows(x: Stored, index: torch.Tensor) -> Stored:
    """Rows `index` (dim 0) of a stored tensor."""
    if isinstance(x, QuantizedTensor):
        return dataclasses.replace(x, data=x.data[index], scale=x.scale[index], min=x.min[index],
                                   shape=(len(index), *x.shape[1:]))
    return x[index]
