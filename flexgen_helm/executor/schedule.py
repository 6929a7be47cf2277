"""The zig-zag block schedule (FlexGen Section 4.1, Algorithm 1).

A block is GPU batches (plan_blocks: `num_gpu_batches` of `gpu_batch_size` for prompts of one
length, more and smaller ones for mixed lengths). Each token step walks the layers; within a
layer it walks the GPU batches, so a layer's weights are loaded once per step and
reused by the whole block. Each GPU batch is left-padded to its own longest prompt: a
prefill computes only its own columns, which end where the block's longest prompt ends, so
that every later position is shared by the block (the prompts of a block's batches may
differ in length without padding all of them to the longest). While batch k computes
layer j, the copy engine loads layer j+1's weights, batch k+1's cache and activations
(while the last batch computes, batch 0's cache of layer j+1), and stores batch k's.

In a decode step a transformer block multiplies its weights once for the whole block: the
GPU batches' new rows (one per sequence: kilobytes) go through the block's linear layers
together, and only attention, which reads each batch's own KV cache, runs batch by batch;
the head takes their rows together too, up to 64 a call (working_set.head_calls).
A one-row GPU batch would otherwise multiply every weight as a matrix-vector product once
per batch (OPT-6.7B, a block of 16 one-sequence batches on 2 CPU cores: ~12 s of a 19.8 s
step, runs/compare/NOTES.md); the memory that bounds a GPU batch is the prefill's.
Such a step loads the batches' caches a group at a time (cache_buffers.load_group),
the group's reads in flight together, the next group loading while this one attends: read
batch after batch, each small disk read waited behind the weights' large ones (OPT-6.7B, 9%
of the cache on disk, 0.8 MB a batch: 9.9 s of a 13.5 s step for 0.4 GB).

On a CPU the copy engine's cache lane only reads; the compute thread unpacks a load (copies
it into the buffers attention reads, dequantizes a compressed one) after it has sent the
next load's reads out. Unpacked on the lane, the disk idled while the lane converted:
OPT-1.3B, weights and cache on disk, 0.89 s of a 4.43 s step's 3.93 s cache lane. A dense
cache read off disk needs no unpacking at all: its read leaves a row for the new token and
attention reads it in place (KVCacheSlot.reads_in_place). On a GPU the unpack holds the
host-to-device copy, which belongs on the lane's stream, so it stays there.

`timers` (seconds): "compute" and "wait_*" (time the compute thread waited for a load)
over the whole run, plus per stage "{prefill,decode}_{compute,load_weight,load_cache,
load_hidden,store_cache,store_hidden}": the run time of each kind of event. With overlap
off these add up to the stage's time (the paper's Table 23 breakdown); with overlap on
the transfers run beside compute, so their times overlap it. On a GPU the compute times are
the host's unless the runtime synchronizes its stage timers (ModelRuntime.sync_stage_timers,
bench --breakdown): a wait for the device after every layer drained its queue, and an H100
ran OPT-1.3B's decode from RAM slower with overlap on than off (runs/gpu/h100-2026-11-26).
Two parts of those:
"decode_attention" (of decode_compute: attention over the cache, its new column and mask
included) and "decode_unpack_cache" (copying, or dequantizing, the cache read into the
buffers attention reads: of decode_compute on a CPU, of decode_load_cache on a GPU), and
"prefill_shared_prefix" (of prefill_compute: the block's shared prompt prefix, run once),
"decode_unpack_prefix" (of decode_attention: its one copy, where a compressed cache or sparse
attention holds it as stored, made ready for attention once a layer a step: held_prefix.py).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from flexgen_helm.compression import kivi
from flexgen_helm.compression.quantize import CACHE_GROUP_DIM, fake_quantize
from flexgen_helm.compression.stored import dense, encode
from flexgen_helm.executor.activations import ActivationHome
from flexgen_helm.executor.attention import (
    DecodePrefix,
    attend,
    attend_as_decode,
    attend_past_held_prefix,
    attend_past_shared_prefix,
    decode_cache_dtype,
    from_units,
    prefix_for_decode,
    to_units,
    unit_sinks,
)
from flexgen_helm.executor.cache_buffers import CacheBuffers, buffer_sets, load_group, unpacks_on_lane
from flexgen_helm.executor.expert_weights import load_layer_weights
from flexgen_helm.executor.held_prefix import HeldPrefix, reads_prefix_as_stored, rounded_prefix
from flexgen_helm.executor.kivi_cache import KiviCacheSlot
from flexgen_helm.executor.kv_cache import (
    KVCacheSlot,
    cache_rows,
    held_prefix_len,
    kv_nbytes,
    prefix_held_once,
    rounded_group_rows,
)
from flexgen_helm.executor.shared_prefix import PrefixLayer, SharedPrefix
from flexgen_helm.executor.step_rows import StepRows, units_of
from flexgen_helm.executor.transfer_ways import anything_to_overlap, copies_on_streams
from flexgen_helm.executor.working_set import decode_head_rows, dense_weight_numel, head_calls, kept_freed_bytes
from flexgen_helm.memory.copy_engine import CopyEngine, consume
from flexgen_helm.memory.disk_buffer import OFFLOAD_ADVICE
from flexgen_helm.memory.disk_space import check_free_space
from flexgen_helm.memory.host_allocator import freed_beyond, hand_back_freed_memory
from flexgen_helm.memory.placement import slot_tier_counts
from flexgen_helm.memory.usage import tensor_bytes
from flexgen_helm.memory.weight_homes import load_nbytes
from flexgen_helm.models.spec import SINKS
from flexgen_helm.policy.policy import TIERS, Policy


@dataclass
class GpuBatch:
    """Left-padded prompts of one GPU batch (CPU tensors)."""

    ids: torch.Tensor  # (b, s) int64
    valid: torch.Tensor  # (b, s) bool, False on left padding

    @property
    def size(self) -> int:
        return self.ids.shape[0]


@dataclass
class CacheLoad:
    """One cache load of a layer: batches `ks`' cache as read off the tiers (`stored`), then,
    once unpacked where attention runs, `parts` (per batch, per tier)."""

    layer: object
    ks: list[int]
    stored: list[dict] | None
    parts: list[dict] | None = None


# head(k, weights, hidden) -> whatever the caller wants from GPU batch k's last layer; a decode
# step calls it for several live batches' computed rows together (k None) and splits its
# output, a tensor, by rows: a decode step's head (generation's) works row by row, and a head
# that needs its batch (scoring's) runs only in prefills
HeadFn = Callable[[int | None, dict, torch.Tensor], object]
# seconds between two looks at the freed host memory kept resident, at least; and at most
# this share of the time goes to looking: a look asks malloc (mallinfo2), which walks its
# free lists, 4 us on a fresh heap but 2.7 ms in a SmolLM2 LAMBADA eval, where one look
# every 50 ms took 5% of the scoring time
RELEASE_CHECK_S = 0.05
RELEASE_CHECK_SHARE = 0.01
# the most elements of K and V (both) that wait to be rounded together (_write_rounded_together):
# past a few million a write's rounding is its passes over them, not its ops' fixed costs
ROUNDED_TOGETHER_ELEMENTS = 1 << 22


def shared_weights(layer, loaded: dict, following) -> dict:
    """What `layer` loaded (`loaded`, by key) of the weights `following` uses too, by store
    name: a tied weight assembled once for both layers instead of once each, both resident."""
    wanted = {t.store_name for t in following.tensors}
    return {t.store_name: loaded[t.key] for t in layer.tensors if t.store_name in wanted}


class BlockSchedule:
    def __init__(self, runtime, policy: Policy, batches: list[GpuBatch], max_len: int, workdir: Path,
                 head_rows: int | None = None, shared_prefix: SharedPrefix | None = None):
        """head_rows: the most positions a call of the head turns into log-probs (default: a
        decode step's, the last positions of GPU batches merged: decode_head_rows); its working set is kept
        resident with the layers' (working_set.kept_freed_bytes). shared_prefix: the tokens
        every prompt of the block starts with, computed once (executor/shared_prefix.py; a
        pipeline stage's block runs as micro-batches whose schedules share one), leaving each
        prompt one token of its own at least; None: each prompt whole."""
        self.rt = runtime
        self.cfg = runtime.config
        self.family = runtime.family
        self.policy = policy
        self.batches = batches
        self.devices = runtime.devices
        self.timers = defaultdict(float)
        overlap = policy.overlap and anything_to_overlap(policy, self.devices.is_cuda)
        on_streams = copies_on_streams(policy, self.cfg, self.devices.is_cuda)  # (a bad setting fails on any device)
        self.io = CopyEngine(overlap, self.devices.compute, self.timers, on_streams=on_streams and overlap)
        self.length = 0  # positions in the cache so far
        # the block's prompt columns; GPU batch k's own start at prompt_start[k] (shorter
        # batches skip the columns before, which no row of theirs sees)
        self.prompt_len = max(b.ids.shape[1] for b in batches)
        self.prompt_start = [self.prompt_len - b.ids.shape[1] for b in batches]
        # per-run constants (the rotary tables), for every position this run will reach
        self.constants = self.family.run_constants(self.cfg, max_len, self.devices.compute, self.devices.dtype)
        # each layer's weights loaded once for the block, compressed ones kept dense (policy.keep_dense_weights),
        # for the blocks after it too where every weight is in the compute tier's memory; first, so that
        # copies an earlier block left and this one does not keep go before it allocates anything
        self.kept = runtime.dense_copies(policy.keep_dense_weights, policy.dense_copies_across_blocks)
        self.shared = self._shared_prefix(shared_prefix)
        self.prefix_here = None  # the shared prefix at the layer a prefill is running (PrefixLayer)
        # the shared prefix's keys and values by block, kept for decode steps of global blocks
        # (no sliding window): they attend to it once for all sequences, and the block's
        # slots hold out the positions every row's copy covers (kv_cache module doc); each
        # row's prefix starts at prefix_start[k][row] of the block's columns. A plain cache's
        # dense attention reads it as computed (DecodePrefix, attend_past_shared_prefix); a
        # compressed cache, or sparse attention, as the slots store it (HeldPrefix, its part
        # held_prefix_len: under KIVI the prefix's complete groups), dequantized once a layer
        # a step where attention runs (attend_past_held_prefix)
        self.decode_prefix: dict[tuple[int, str], DecodePrefix | HeldPrefix] = {}
        self._prefix_bytes: list[tuple[str, int]] = []  # (tier, bytes) of each copy, in TierUsage
        shared_len = self.shared.length if self.shared is not None else 0
        self.held_prefix_len = held_prefix_len(shared_len, policy.compress_cache)
        self.keeps_decode_prefix = self.held_prefix_len > 0 and prefix_held_once(policy)
        self.prefix_as_stored = reads_prefix_as_stored(policy)
        # a HeldPrefix's dequantized keys and values, by device type: (layer, step) and them
        self._prefix_unpacked: dict[str, tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
        self._prefix_buffers = CacheBuffers(1)  # what they are unpacked into (the compute thread's own)
        self.prefix_start = [first + (~b.valid).sum(1) for b, first in zip(batches, self.prompt_start)]
        blocks = [layer.index for layer in runtime.layers if layer.kind == "block"]
        cache_units = slot_tier_counts(policy.cache, [b.size * self.cfg.num_kv_heads for b in batches], blocks)
        act_rows = slot_tier_counts(policy.activations, [b.size for b in batches])
        # every disk file of the run at once, before any is made: one clear error, not the Nth file's
        planned = sum(KVCacheSlot.disk_nbytes(u["disk"], max_len, self.cfg.head_dim, self.devices.dtype,
                                              policy.cache_storage, self.cfg.window(index), self._held_out(index, k))
                      for (index, k), u in cache_units.items() if u["disk"])
        planned += sum(ActivationHome.disk_nbytes(r["disk"], max_len, self.cfg.hidden_size, self.devices.dtype)
                       for r in act_rows.values())
        if planned:
            check_free_space(workdir, planned, "this block's offloaded KV cache and activations",
                             OFFLOAD_ADVICE)
        # each cache unit's first real position in the block's columns (the columns its batch
        # skips, then its own left padding): where a KIVI cache's groups start
        self.unit_starts = [((~b.valid).sum(1) + first).repeat_interleave(self.cfg.num_kv_heads)
                            for b, first in zip(batches, self.prompt_start)]
        self.slots: dict[tuple[int, int], KVCacheSlot | KiviCacheSlot] = {
            (index, k): self._slot(units, max_len, workdir / f"kv-{index}-{k}.bin", self.cfg.window(index), index, k)
            for (index, k), units in cache_units.items()}
        self.unpack_on_lane = unpacks_on_lane(self.devices.is_cuda)
        # what decode steps unpack the cache into, reused
        self.buffers = CacheBuffers(buffer_sets(self.unpack_on_lane))
        # a merged decode step's GPU batches per cache load
        self.load_group = self._load_group(max_len, len(batches))
        self.acts = [ActivationHome(act_rows[0, k], max_len, self.cfg.hidden_size, self.devices, runtime.usage,
                                    workdir / f"act-{k}.bin") for k in range(len(batches))]
        # the columns each GPU batch's prefill computes (the last ones): all, or those after the shared prefix
        self.window = [b.ids.shape[1] - shared_len for b in batches]
        # keys each row may see, for every position of the run: the prompt's real tokens,
        # then every generated one (a step takes a view, instead of growing it by a cat)
        self.key_valid = [torch.ones(b.size, max_len, dtype=torch.bool) for b in batches]
        for valid, b, first in zip(self.key_valid, batches, self.prompt_start):
            valid[:, :first] = False
            valid[:, first:self.prompt_len] = b.valid
        self.real_len = [b.valid.sum(1) for b in batches]
        # rows each GPU batch computes from the next decode step on (None: all); see compute_only
        self.active: list[list[int] | None] = [None] * len(batches)
        self.step_rows: list[StepRows | None] = [None] * len(batches)
        self._weights_ahead = None
        self._rounding_writes: list = []  # a decode step's (block, batch, write) rounded at its end
        self.prefill_as_decode = False
        self.stores_prefill_cache = True
        # freed host memory kept for reuse beyond this is handed back (memory/host_allocator.py)
        self.keep_freed = kept_freed_bytes(self.cfg, max(b.size for b in batches), self.prompt_len,
                                           self.devices.dtype,
                                           dense_weight_numel(runtime.layers, policy.compress_weight),
                                           max(map(self._load_nbytes, runtime.layers)),
                                           self._head_rows(head_rows))
        self._freed_checked_at = 0.0
        self._freed_check_every = RELEASE_CHECK_S

    def _head_rows(self, given: int | None) -> int:
        """The most positions a call of the head takes (given, else a decode step's merged
        calls'); none in a pipeline stage without the head."""
        if self.rt.layers[-1].kind != "head":
            return 0
        return decode_head_rows(max(b.size for b in self.batches), len(self.batches)) if given is None else given

    def _shared_prefix(self, prefix: SharedPrefix | None) -> SharedPrefix | None:
        """The prefix, checked; its positions' step constants in prefix_at."""
        self.prefix_at = None
        if prefix is None:
            return None
        if min(int(b.valid.sum(1).min()) for b in self.batches) <= prefix.length:
            raise ValueError("a shared prefix must leave every prompt a token of its own")
        positions = torch.arange(prefix.length, device=self.devices.compute)[None]
        self.prefix_at = self.family.step_constants(self.constants, positions)
        return prefix

    def _keep_decode_prefix(self, index: int, here: PrefixLayer) -> None:
        """Block `index`'s prefix as decode attention reads it where it runs, made once (by
        the block's first micro-batch), not at every step of every layer: in the layout a
        plain cache's dense attention reads (DecodePrefix), or, under cache compression or
        sparse attention, stored as the slots store it (HeldPrefix). Counted where the
        cache's compute-side tier is (the planner counts it there), by the schedule that
        made it."""
        keys, values = here.keys, here.values
        if self.policy.rounds_cache_writes:  # what every row's slot holds of the positions held once
            keys, values = rounded_prefix(keys, values, self.policy.compress_cache, self.devices.dtype)
        for where in {self._attention_device(t) for t in self.policy.cache.tiers()}:  # as budget.prefix_copy_tiers
            kept = here.decode.get(where.type)
            if kept is None:
                if self.prefix_as_stored:
                    kept = HeldPrefix(keys, values, self.policy.cache_storage, self.devices.dtype, where)
                    nbytes = kept.nbytes
                else:
                    kept = prefix_for_decode(keys.to(where), values.to(where), where, self.devices.dtype,
                                             self.cfg.attn_softcap)
                    nbytes = tensor_bytes(kept.keys) + tensor_bytes(kept.values) + tensor_bytes(kept.key_mean)
                here.decode[where.type] = kept
                self._prefix_bytes.append(("gpu" if where == self.devices.compute else "cpu", nbytes))
                self.rt.usage.add(*self._prefix_bytes[-1])
            self.decode_prefix[index, where.type] = kept

    def _attends_to_prefix_apart(self, index: int) -> bool:
        """Whether block `index`'s decode steps attend to the shared prefix's one copy."""
        return self.keeps_decode_prefix and not self.cfg.window(index)

    def _held_out(self, index: int, k: int) -> tuple[int, int] | None:
        """The positions [a, b) of block `index` that every row of GPU batch k holds the
        shared prefix at (its rows' paddings differ, so each copy starts elsewhere), which
        its slot leaves to the prefix's one copy; None where there are none. A KIVI slot's
        (0, b): b = the prefix's complete groups' positions, counted from each row's first
        real token, whatever the paddings."""
        if not self._attends_to_prefix_apart(index):
            return None
        if self.policy.cache_storage is not None and self.policy.cache_storage.kivi:
            return 0, self.held_prefix_len
        a, b = int(self.prefix_start[k].max()), int(self.prefix_start[k].min()) + self.held_prefix_len
        return (a, b) if a < b else None

    def _slot(self, units: dict[str, int], max_len: int, disk_path: Path, window: int, index: int, k: int):
        cfg = self.policy.cache_storage
        if cfg is not None and cfg.kivi:
            held_out = self._held_out(index, k)
            return KiviCacheSlot(units, max_len, self.cfg.head_dim, self.devices, self.rt.usage, disk_path, pin=True,
                                 compression=cfg, window=window, starts=self.unit_starts[k],
                                 held_out_groups=held_out[1] // cfg.group_size if held_out else 0)
        return KVCacheSlot(units, max_len, self.cfg.head_dim, self.devices, self.rt.usage, disk_path, pin=True,
                           compression=cfg, window=window, held_out=self._held_out(index, k),
                           rounding=self.policy.compress_cache if self.policy.rounds_cache_writes else None,
                           starts=self.unit_starts[k])

    # ---- one token step over the whole block -------------------------------------------

    # A runtime may hold only some layers (a pipeline stage): when it starts after the
    # embedding, the inputs are hidden states instead of token ids, and when it ends
    # before the head (head=None), the outputs are the hidden states it computed.

    def prefill(self, head: HeadFn | None, hidden: list[torch.Tensor] | None = None, as_decode: bool = False,
                decode_follows: bool = True) -> list:
        """as_decode: every prompt position attends as a decode step would (attend_as_decode),
        to score what the cache's compression and sparsity cost at every position.
        decode_follows: False where no decode step will read the cache (a score, a single
        generated token): the prompts' keys and values are then not stored (nor quantized)."""
        # without cache compression or sparsity a decode step attends exactly as the prefill does
        self.prefill_as_decode = as_decode and (self.policy.compress_cache is not None or self.policy.attn_sparsity < 1)
        self.stores_prefill_cache = decode_follows
        if self.shared is not None and self.prefill_as_decode:
            raise ValueError("a shared prefix runs with plain prompt attention")
        for k, b in enumerate(self.batches):
            positions = (b.valid.long().cumsum(1) - 1).clamp(min=0)[:, -self.window[k]:]
            self.step_rows[k] = self._step_rows(k, None, positions, self.prompt_len, first=self.prompt_start[k])
        out = self._step([b.ids[:, -w:] for b, w in zip(self.batches, self.window)] if hidden is None else hidden,
                         head, prefill=True)
        self.length = self.prompt_len
        self.shared = self.prefix_here = None  # its keys and values are in every row's cache now
        return out

    def compute_only(self, k: int, rows: list[int]) -> None:
        """From the next decode step on, GPU batch k computes only these rows (its sequences
        not finished): the others leave the layers' matmuls, the attention and the head, and
        the head's output at a step has one row per computed row, in order."""
        self.active[k] = None if len(rows) == self.batches[k].size else sorted(rows)

    def decode(self, tokens: list[torch.Tensor], head: HeadFn | None) -> list:
        """Feed one new token per sequence (tokens[k]: (b,) int64, or the (b, 1, hidden)
        states of the stage before; rows not computed are ignored) and run the block. A
        GPU batch computing no row gives None."""
        step = self.length - self.prompt_len
        for k in range(len(tokens)):
            self.step_rows[k] = self._step_rows(k, self.active[k], (self.real_len[k] + step)[:, None], self.length + 1)
        out = self._step([t[:, None] if t.dim() == 1 else t for t in tokens], head, prefill=False)
        self.length += 1
        return out

    def _step_rows(self, k: int, rows: list[int] | None, positions: torch.Tensor, t: int, first: int = 0) -> StepRows:
        """What the layers of a step over the block's positions [first, t) share for batch k;
        positions: (b, s)."""
        kvh, compute = self.cfg.num_kv_heads, self.devices.compute
        valid = self.key_valid[k][:, first:t]
        picked = None if rows is None else torch.tensor(rows, dtype=torch.long)
        if picked is not None:
            valid, positions = valid[picked], positions[picked]
        positions = positions.to(compute)
        units = None if rows is None else units_of(rows, kvh)
        return StepRows(picked, units, valid.repeat_interleave(kvh, dim=0).to(compute), positions,
                        self.family.step_constants(self.constants, positions),
                        None if units is None else torch.tensor(units))

    def _step(self, inputs, head: HeadFn, prefill: bool) -> list:
        """One token step: every layer for every GPU batch, each batch's inputs (weights of the
        next layer, cache, hidden state) loading while the batch before computes."""
        layers, nb, io = self.rt.layers, len(self.batches), self.io
        stage = "prefill" if prefill else "decode"
        results = [None] * nb
        if layers[0].kind != "embed":
            for k, hidden_in in enumerate(inputs):
                io.submit(self.acts[k].store, hidden_in, kind=f"{stage}_store_hidden")
        live = [k for k in range(nb) if not self.step_rows[k].empty]  # batches with rows to compute
        # taken, not kept: held past its layer, a prefetched layer's weights stayed resident all step
        # a layer's disk reads at once; a sparse block's experts as its router picks them
        load_layer = functools.partial(load_layer_weights, self.rt, io, self.timers, stage,
                                       after_release=self._bound_freed_memory)
        if self.kept is not None:
            load_layer = functools.partial(self.kept, load_layer)
        weights = self._weights_ahead or io.submit(load_layer, layers[0], kind=f"{stage}_load_weight",
                                                   lane="weights")
        self._weights_ahead = None
        cache_ahead = None  # the first live batch's cache of the next layer
        for j, layer in enumerate(layers):
            w = self._wait(weights, "load_weight")
            # prefetch the next layer (after the last, the first layer of the next step), reusing
            # what this one loaded of a weight they share (the tied head and embedding)
            following = layers[(j + 1) % len(layers)]
            weights = io.submit(load_layer, following, shared_weights(layer, w, following),
                                kind=f"{stage}_load_weight", lane="weights")
            if not live:
                continue
            if prefill and self.shared is not None:
                t0 = time.perf_counter()
                self.prefix_here = self.shared.run_layer(self.family, self.cfg, layer, w, self.prefix_at)
                if layer.kind == "block" and self._attends_to_prefix_apart(layer.index):
                    self._keep_decode_prefix(layer.index, self.prefix_here)
                self._time_compute(t0, stage)
                self.timers["prefill_shared_prefix"] += time.perf_counter() - t0  # of prefill_compute
            cache = cache_ahead or self._submit_cache_ahead(layer, live, prefill)
            next_layer = layers[j + 1] if j + 1 < len(layers) else None
            if self._merges(layer, live, prefill):
                if layer.kind == "head":
                    results = self._merged_decode_head(layer, w, live, head)
                else:
                    outs, cache_ahead = self._merged_decode_block(layer, w, live, cache, next_layer)
                    for k, (out, new_kv) in zip(live, outs):
                        self._submit_stores(layer, k, out, new_kv, stage)
                del w
                self._bound_freed_memory()
                continue
            if prefill and len(live) > 1 and self._gathers(layer):
                self._gathered_prefill_block(layer, w, live)
                del w
                self._bound_freed_memory()
                continue
            hidden = self._submit_hidden_load(layer, live[0], stage)
            for i, k in enumerate(live):
                h = self._wait(hidden, "load_hidden") if hidden is not None else None
                load = self._wait(cache, "load_cache") if cache is not None else None
                if i + 1 < len(live):  # the next batch's inputs travel while batch k computes
                    cache = self._submit_cache_load(layer, live[i + 1], prefill)
                    hidden = self._submit_hidden_load(layer, live[i + 1], stage)
                else:  # the next layer's first cache travels while the last batch computes (its
                    # hidden state cannot: this layer's compute makes it)
                    cache_ahead = self._submit_cache_ahead(next_layer, live, prefill)
                kv = self._unpacked(load)[0] if load is not None else None
                out, new_kv = self._run_layer(layer, k, w, h, kv, inputs[k], head, prefill)
                if layer.kind == "head":
                    results[k] = out
                else:
                    self._submit_stores(layer, k, out, new_kv, stage)
            del w
            self._bound_freed_memory()
        self._weights_ahead = weights
        self._write_rounded_together(stage)
        if self.kept is not None:
            self.kept.count_dense_copies()
        if layers[-1].kind != "head":
            results = [self._wait(io.submit(a.load, kind=f"{stage}_load_hidden"), "load_hidden") for a in self.acts]
        return results

    def _load_nbytes(self, layer) -> int:
        """Bytes a load of the layer's weights makes beside their homes (weight_homes.load_nbytes)."""
        return sum(load_nbytes(h.spec, h.segments, h.compression, self.devices.dtype, self.devices.is_cuda)
                   for h in (self.rt.homes[t.store_name] for t in layer.tensors))

    def _bound_freed_memory(self) -> None:
        """Between layers (and within a sparse MoE block: before and after its experts, and as
        each expert's rows are done), at most every RELEASE_CHECK_S (and less often when a look
        takes longer than RELEASE_CHECK_SHARE of that): hand back the freed host memory resident
        beyond keep_freed (its fragments outgrew the working set, 0.7 GiB over one OPT-1.3B
        prefill); the time it takes is timed as "release_freed_memory" (within a layer, also
        inside that layer's compute time). Only the look sets when the next one comes: a
        hand-back's own time (~0.1 s for 0.9 GiB) had pushed the next look ~10 s away, while a
        4-bit OLMoE prefill's freed memory grew 0.9 GiB past keep_freed, its peak RSS with it
        (runs/moe/host_memory)."""
        now = time.perf_counter()
        if now - self._freed_checked_at < self._freed_check_every:
            return
        over = freed_beyond(self.keep_freed)
        looked = time.perf_counter()
        if over and hand_back_freed_memory():
            self.timers["release_freed_memory"] += time.perf_counter() - now
        self._freed_check_every = max(RELEASE_CHECK_S, (looked - now) / RELEASE_CHECK_SHARE)
        self._freed_checked_at = time.perf_counter()

    def _submit_hidden_load(self, layer, k: int, stage: str):
        """A future for batch k's hidden state (None before the embedding: it reads token ids)."""
        if layer.kind == "embed":
            return None
        return self.io.submit(self.acts[k].load, kind=f"{stage}_load_hidden")

    def _run_layer(self, layer, k: int, w: dict, h, kv, batch_input, head: HeadFn, prefill: bool):
        """One layer for GPU batch k, timed as compute, on the rows it computes at this step:
        its output (the whole batch's hidden state, or what the head makes of the computed
        rows) and, for a block, the new positions' keys and values."""
        rows = self.step_rows[k]
        new_kv = None
        t0 = time.perf_counter()
        if layer.kind == "embed":
            part = self.family.embed(self.cfg, w, rows.take(batch_input).to(self.devices.compute), rows.positions)
            out = rows.put(part.new_zeros(self.batches[k].size, *part.shape[1:]), part)
        elif layer.kind == "block":
            part, new_kv = self._block(layer.index, k, w, rows.take(h), kv, prefill)
            out = rows.put(h, part)
        else:
            out = head(k, w, rows.take(h))
        self._time_compute(t0, "prefill" if prefill else "decode")
        return out, new_kv

    def _submit_stores(self, layer, k: int, hidden: torch.Tensor, new_kv, stage: str) -> None:
        """Batch k's new cache positions (of a block) and hidden state go to their tiers; a
        decode step's writes that round to the per-token grid wait to be rounded with the
        step's others (_write_rounded_together)."""
        if new_kv is not None and stage == "decode" and self._rounds_together(layer.index, k, new_kv):
            self._rounding_writes.append((layer.index, k, new_kv))
            if sum(2 * kv[0].numel() for _, _, kv in self._rounding_writes) >= ROUNDED_TOGETHER_ELEMENTS:
                self._write_rounded_together(stage)
        elif new_kv is not None:
            self.io.submit(self.slots[layer.index, k].write, *new_kv, kind=f"{stage}_store_cache")
        self.io.submit(self.acts[k].store, hidden, kind=f"{stage}_store_hidden")

    def _rounds_together(self, index: int, k: int, new_kv: tuple) -> bool:
        """Whether batch k's decode write at block `index` is rounded with the step's others
        (_write_rounded_together): a small one (ROUNDED_TOGETHER_ELEMENTS) to a slot that rounds
        each write to the per-token grid, RTN's, whose min, max and division
        give each group the same bits in any call (HQQ's fitted scales come out of reductions
        whose order may follow the call's size). A prefill's writes round as they are stored,
        on the copy thread beside the next layers' compute: rounded together at the prefill's
        end instead, the main job's 8-bit prefills took 3-7% longer
        (runs/compression_8bit/decode_paths/step_rounding_ab.jsonl)."""
        slot = self.slots[index, k]
        return (getattr(slot, "rounds_each_write", False) and slot.rounding.method == "rtn"
                and 2 * new_kv[0].numel() < ROUNDED_TOGETHER_ELEMENTS)

    def _write_rounded_together(self, stage: str) -> None:
        """The decode writes waiting to be rounded (_rounds_together), every layer's and GPU
        batch's of the step so far, rounded in one call and then written: the rounding is ~20
        small ops whatever the rows, and once per layer and batch the main job's 8-bit decode
        spent ~10% of its time in them (runs/compression_8bit/README.md). Each position and
        unit is its own group, so the bits are those of rounding each write apart. Nothing
        reads a layer's cache again within its step, and the next step's loads run after
        these writes on their lane (copy_engine: in submission order)."""
        pending, self._rounding_writes = self._rounding_writes, []
        if not pending:
            return
        t0 = time.perf_counter()
        parts = [x.reshape(-1, x.shape[-1]) for _, _, new_kv in pending for x in new_kv[:2]]
        index, k, _ = pending[0]
        rounded = fake_quantize(torch.cat(parts)[None], self.slots[index, k].rounding, CACHE_GROUP_DIM)[0]
        rounded = rounded.split([len(x) for x in parts])
        self._time_compute(t0, stage)
        for i, (index, k, new_kv) in enumerate(pending):
            k_part, v_part = (rounded[2 * i + j].view(new_kv[j].shape) for j in (0, 1))
            self.io.submit(self.slots[index, k].write, k_part, v_part, *new_kv[2:], True,
                           kind=f"{stage}_store_cache")

    def _wait(self, future, what: str):
        t0 = time.perf_counter()
        value = consume(future.result(), self.devices.compute)
        self.timers[f"wait_{what}"] += time.perf_counter() - t0
        return value

    # ---- a transformer block for one GPU batch -------------------------------------------

    @staticmethod
    def _merges(layer, live: list[int], prefill: bool) -> bool:
        """Whether this layer's step runs the live GPU batches together (_merged_decode_block,
        _merged_decode_head)."""
        return not prefill and layer.kind in ("block", "head") and len(live) > 1

    def _submit_cache_ahead(self, layer, live: list[int], prefill: bool):
        """A future for the cache that `layer` (None: past the last) reads first: the first
        group's of live batches where its step merges them, else the first live batch's."""
        if layer is None or layer.kind != "block":  # only a block reads a cache
            return None
        if self._merges(layer, live, prefill):
            return self._submit_group_load(layer, live[:self.load_group])
        return self._submit_cache_load(layer, live[0], prefill)

    def _submit_group_load(self, layer, ks: list[int]):
        return self.io.submit(self._load_group_cache, layer, ks, kind="decode_load_cache")

    def _submit_cache_load(self, layer, k: int, prefill: bool):
        """A future for batch k's cache of a block layer (None where nothing is read: a
        prefill attends only to its own keys and values)."""
        if prefill or layer.kind != "block":
            return None
        return self._submit_group_load(layer, [k])

    def _load_group_cache(self, layer, ks: list[int]) -> CacheLoad:
        """Batches ks' cache of this layer (the positions each slot holds), their reads in
        flight together (CopyEngine.fan_out); unpacked here on a GPU only (module doc)."""
        load = CacheLoad(layer, ks, self.io.fan_out(functools.partial(self._read_cache, layer), ks))
        if self.unpack_on_lane:
            self._unpack(load)
        return load

    def _unpacked(self, load: CacheLoad) -> list[dict]:
        """(The compute thread.) Per batch of the load, each tier's part of its cache where its
        attention will run (none for a tier that attention reads in place, or where no unit
        computes): unpacked here, timed as compute, unless the lane did."""
        if load.parts is None:
            t0 = time.perf_counter()
            self._unpack(load)
            self._time_compute(t0)
        return consume(load.parts, self.devices.compute)

    def _unpack(self, load: CacheLoad) -> None:
        """Each batch's parts of the load, in buffers where attention runs, tier by tier:
        compressed parts travel compressed and are dequantized there, a tier's batches in as
        few calls as the slot can (unpack_batches)."""
        t0 = time.perf_counter()
        self.buffers.next_set()
        load.parts = [{} for _ in load.ks]
        for tier in TIERS:
            batches = [i for i, stored in enumerate(load.stored) if tier in stored]
            if not batches:
                continue
            where = self._attention_device(tier)
            slot = self.slots[load.layer.index, load.ks[batches[0]]]  # a layer's slots differ by their units only
            unpacked = slot.unpack_batches(tier, [load.stored[i][tier] for i in batches], where,
                                           decode_cache_dtype(where, self.devices.dtype),
                                           [self.buffers.of_batch(i) for i in batches])
            for i, part in zip(batches, unpacked):
                load.parts[i][tier] = part
        load.stored = None  # as read: no longer needed
        self.timers["decode_unpack_cache"] += time.perf_counter() - t0

    def _load_group(self, max_len: int, batches: int) -> int:
        """GPU batches in one cache load of a decode step (cache_buffers.load_group), from the
        largest of a batch's loads of a layer: its part off the tiers that attention does not
        read in place, as read and as unpacked (at the longest its slot holds)."""
        as_read = unpacked = 0.0
        for (index, _), slot in self.slots.items():
            rows = cache_rows(max_len, self.cfg.window(index), least=rounded_group_rows(self.policy))
            moved = [t for t in TIERS if slot.units[t] and not slot.in_place(t, self._attention_device(t))]
            as_read = max(as_read, sum(kv_nbytes(rows, slot.units[t], self.cfg.head_dim, self.devices.dtype,
                                                 self.policy.cache_storage) for t in moved))
            unpacked = max(unpacked, sum(kv_nbytes(rows, slot.units[t], self.cfg.head_dim,
                                                   decode_cache_dtype(self._attention_device(t), self.devices.dtype),
                                                   None)
                                         for t in moved if not slot.reads_in_place(t, self._attention_device(t))))
        return load_group(as_read, unpacked, batches, self.unpack_on_lane)[0]

    def _read_cache(self, layer, k: int) -> dict:
        """Of batch k's cache of this layer, each tier's part that attention reads off its tier, as stored."""
        slot, stored = self.slots[layer.index, k], {}
        for tier in TIERS:
            computed, _ = self.step_rows[k].tier_part(*slot.ranges[tier])
            where = self._attention_device(tier)
            if computed.start < computed.stop and not slot.in_place(tier, where):
                # Sparse attention reads V from disk after scoring, and only the rows it keeps.
                sparse_disk = tier == "disk" and self.policy.attn_sparsity < 1.0 and slot.values_apart
                stored[tier] = slot.read(tier, self.length, values=not sparse_disk,
                                         room=slot.reads_in_place(tier, where))
        return stored

    def _attention_device(self, tier: str) -> torch.device:
        delegate = self.policy.cpu_cache_compute and tier != "gpu"
        return self.devices.cpu if delegate else self.devices.compute

    def _merged_decode_block(self, layer, w: dict, live: list[int], cache, following):
        """One decode step of a transformer block for the live GPU batches together: their
        computed rows through the linear layers as one matrix, attention batch by batch over
        their caches, loaded a group at a time (`cache`: the first group's; the next group's,
        after the last this layer's, `following`'s first, load while a group attends). Returns
        per batch (hidden state after the block, cache write or None) and the future of that
        next cache."""
        hs = self._live_hidden(layer, live)
        rows = [self.step_rows[k] for k in live]
        t0 = time.perf_counter()
        parts = [r.take(h) for r, h in zip(rows, hs)]
        sizes = [p.shape[0] for p in parts]
        h_all = torch.cat(parts)
        at = rows[0].per_step(("merged step constants", tuple(live)), lambda: self.family.step_constants(
            self.constants, torch.cat([r.positions for r in rows])))  # the same for every layer of the step
        qkv = [x.split(sizes) for x in self.family.qkv(self.cfg, w, h_all, at, layer.index)]
        self._time_compute(t0)
        attn, writes = [], []
        for i, k in enumerate(live):
            if i % self.load_group == 0:  # this group's cache, and the next group's on its way
                load = self._wait(cache, "load_cache")
                rest = live[i + self.load_group:]
                cache = self._submit_group_load(layer, rest[:self.load_group]) if rest else \
                    self._submit_cache_ahead(following, live, False)
                kvs = self._unpacked(load)
            t0 = time.perf_counter()
            out, write = self._attend(layer.index, k, *(x[i] for x in qkv), kvs[i % self.load_group], False,
                                      w.get(SINKS))
            attn.append(out)
            writes.append(write)
            self._time_compute(t0)
        t0 = time.perf_counter()
        after = self.family.finish_block(self.cfg, w, h_all, torch.cat(attn)).split(sizes)
        outs = [(r.put(h, part), write) for r, h, part, write in zip(rows, hs, after, writes)]
        self._time_compute(t0)
        return outs, cache

    def _live_hidden(self, layer, live: list[int]) -> list[torch.Tensor]:
        """The live GPU batches' hidden states before `layer` in a decode step, their loads in
        flight together."""
        hidden = [self._submit_hidden_load(layer, k, "decode") for k in live]
        return [self._wait(f, "load_hidden") for f in hidden]

    def _merged_decode_head(self, layer, w: dict, live: list[int], head: HeadFn) -> list:
        """A decode step's head for the live GPU batches' computed rows merged, as their blocks
        ran, up to MERGED_HEAD_ROWS rows a call (working_set.head_calls): the vocabulary-wide
        weight multiplied once for many small batches, not once each (runs/bench/merged_head).
        Its output, per GPU batch (None where none computes)."""
        hs = self._live_hidden(layer, live)
        t0 = time.perf_counter()
        parts = [self.step_rows[k].take(h) for k, h in zip(live, hs)]
        results = [None] * len(self.batches)
        for call in head_calls([p.shape[0] for p in parts]):
            outs = head(None, w, torch.cat([parts[i] for i in call])).split([parts[i].shape[0] for i in call])
            for i, out in zip(call, outs):
                results[live[i]] = out
        self._time_compute(t0)
        return results

    def _gathers(self, layer) -> bool:
        """Whether this layer's prefill runs its MLP once for all the block's GPU batches: a
        sparse MoE block, whose experts (loaded as its router picks them, then released:
        executor/expert_weights.py) each multiply the block's rows once."""
        return layer.kind == "block" and self.cfg.sparse_block(layer.index) and hasattr(self.family, "mlp_output")

    def _gathered_prefill_block(self, layer, w: dict, live: list[int]) -> None:
        """A sparse MoE block's prefill: attention GPU batch by batch (each batch's cache
        stored as it is made), then the experts once over every batch's rows together, as a
        decode step merges them. Each batch's rows are written into the block's one buffer as
        its attention ends, so they are held once; freed memory is handed back before the
        experts run and after: the attention's freed buffers, between the held rows, are holes
        that the block-sized tensors cannot reuse, and kept resident they raised a 512 x 128-token
        OLMoE prefill's peak by 2.3 GiB (runs/moe/gathered_prefill_memory)."""
        sizes = [self.step_rows[k].positions.numel() for k in live]
        hidden = self._submit_hidden_load(layer, live[0], "prefill")
        gathered, shapes, start = None, [], 0
        for i, k in enumerate(live):
            h = self._wait(hidden, "load_hidden")
            if i + 1 < len(live):
                hidden = self._submit_hidden_load(layer, live[i + 1], "prefill")
            t0 = time.perf_counter()
            rows = self.step_rows[k]
            assert rows.rows is None, "a prefill computes every row of its GPU batches"
            out, write = self._attend(layer.index, k, *self.family.qkv(self.cfg, w, h, rows.at, layer.index),
                                      None, True, w.get(SINKS))
            mid = self.family.attention_output(self.cfg, w, h, out)
            assert mid.shape[:-1].numel() == sizes[i], "a batch's rows are its positions"
            if gathered is None:
                gathered = mid.new_empty(sum(sizes), mid.shape[-1])
            gathered[start:start + sizes[i]].copy_(mid.reshape(-1, mid.shape[-1]))
            start += sizes[i]
            shapes.append(mid.shape)
            del h, out, mid
            self._time_compute(t0, "prefill")
            if write is not None:
                self.io.submit(self.slots[layer.index, k].write, *write, kind="prefill_store_cache")
        self._bound_freed_memory()
        t0 = time.perf_counter()
        flat = self.family.mlp_output(self.cfg, w, gathered)
        del gathered
        afters = flat.split(sizes)
        self._time_compute(t0, "prefill")
        self._bound_freed_memory()
        for k, shape, after in zip(live, shapes, afters):
            self._submit_stores(layer, k, after.reshape(shape), None, "prefill")

    def _time_compute(self, t0: float, stage: str = "decode") -> None:
        """Counts the compute since t0 in the run's and the stage's timers (on a GPU: finished
        there where the runtime synchronizes its stage timers, else the host's time)."""
        self._stage_done()
        elapsed = time.perf_counter() - t0
        self.timers["compute"] += elapsed
        self.timers[f"{stage}_compute"] += elapsed

    def _stage_done(self) -> None:
        """The end of a timed stretch: on a GPU whose stage timers are synchronized
        (ModelRuntime.sync_stage_timers), wait for the device to finish what was queued."""
        if self.devices.is_cuda and self.rt.sync_stage_timers:
            torch.cuda.current_stream(self.devices.compute).synchronize()

    def _block(self, index: int, k: int, w: dict, h, cache, prefill: bool):
        """h: the computed rows' hidden states. Returns theirs after the block, and the
        arguments of KVCacheSlot.write that store what is not stored yet (None: a decode
        step wrote every tier in place)."""
        q, key, value = self.family.qkv(self.cfg, w, h, self.step_rows[k].at, index)
        out, write = self._attend(index, k, q, key, value, cache, prefill, w.get(SINKS))
        return self.family.finish_block(self.cfg, w, h, out), write

    def _attend(self, index: int, k: int, q, key, value, cache, prefill: bool, sinks: torch.Tensor | None = None):
        """Attention of GPU batch k's computed rows in block `index` over its cache: the
        output (rows, positions, heads x head_dim), and the arguments of KVCacheSlot.write
        that store what is not stored yet (None: a decode step wrote every tier in place).
        sinks: the block's attention sinks (num_heads,), None where the model has none."""
        cfg, rows, slot = self.cfg, self.step_rows[k], self.slots[index, k]
        b, kvh, s, d = key.shape
        qu = to_units(q, kvh)
        sinks = unit_sinks(None if sinks is None else sinks.to(q.device), kvh, 0, b * kvh)
        ku, vu = key.reshape(b * kvh, s, d), value.reshape(b * kvh, s, d)
        unwritten = TIERS if self.stores_prefill_cache else ()  # (a decode step sets its own below)
        window, softcap = cfg.window(index), cfg.attn_softcap
        if prefill and self.prefill_as_decode:
            cc = self.policy.compress_cache
            fresh = cc.group_size if cc is not None and cc.kivi else 1  # positions a decode step sees unquantized
            starts = self.unit_starts[k] - self.prompt_start[k]  # in the batch's own columns
            out = attend_as_decode(qu, ku, vu, rows.valid, functools.partial(self._as_stored, starts),
                                   self.policy.attn_sparsity, window=window, softcap=softcap, fresh_group=fresh,
                                   starts=starts, sinks=sinks)
        elif prefill:
            out = None
            if self.shared is not None:  # the columns before the window: the shared prefix's keys and values
                pad = (~self.batches[k].valid).sum(1)
                split = None if window else self.prefix_here.window_split(pad, qu.device)
                unread = (0, 0)
                if split is not None:  # columns [max(pad), split) are the one copy's: unmade where nothing reads them
                    unread = (0, split) if not unwritten else (int(pad.max()), split)
                    if unwritten and not slot.ignores_writes_to(*unread):
                        unread = (0, 0)
                ku, vu = self.prefix_here.with_context(pad, ku, vu, unread)
                if split is not None:
                    out = self.prefix_here.attend_window(qu, ku, vu, pad, split, rows.valid, softcap, sinks)
            if out is None:
                out = attend(qu, ku, vu, rows.valid, causal=True, window=window, softcap=softcap, sinks=sinks)
        else:
            t0 = time.perf_counter()
            out, unwritten = self._decode_attention(slot, cache, qu, ku, vu, rows, window, index,
                                                    self._prefix_of(index, k), sinks)
            self._stage_done()
            self.timers["decode_attention"] += time.perf_counter() - t0  # part of decode_compute
        out = from_units(out, b)
        if not unwritten:
            return out, None
        if prefill and self.prompt_start[k]:
            # the block's columns before this batch's own: masked for its rows, but written
            # (zeros) so that attention never meets the garbage of an unwritten cache row
            ku, vu = (torch.nn.functional.pad(x, (0, 0, self.prompt_start[k], 0)) for x in (ku, vu))
        return out, (ku.transpose(0, 1), vu.transpose(0, 1), 0 if prefill else self.length, rows.unit_index, unwritten)

    def _unpacked_prefix(self, index: int, where: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `index`'s HeldPrefix, dequantized on `where` once a step: every GPU batch and
        tier attending there at this step reads the same (timed as "decode_unpack_prefix", of
        decode_attention)."""
        done = self._prefix_unpacked.get(where.type)
        if done is None or done[0] != (index, self.length):
            t0 = time.perf_counter()
            kv = self.decode_prefix[index, where.type].unpack(decode_cache_dtype(where, self.devices.dtype),
                                                                self._prefix_buffers)
            done = self._prefix_unpacked[where.type] = ((index, self.length), kv)
            self.timers["decode_unpack_prefix"] += time.perf_counter() - t0
        return done[1]

    def _as_stored(self, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(units, t, d) keys and values (units starting at `starts`) -> what the cache returns
        for them (a slot's write then read: the same encoding, in the cache's layout)."""
        cfg, dtype = self.policy.compress_cache, self.devices.dtype
        read_as = decode_cache_dtype(self.devices.compute, dtype)  # as a decode step's attention reads it
        if cfg is not None and cfg.kivi:
            return kivi.as_stored(k.to(dtype), v.to(dtype), cfg, starts, read_as)
        gd = None if cfg is None else CACHE_GROUP_DIM
        return tuple(dense(encode(x.transpose(0, 1).to(dtype), cfg, gd), read_as).transpose(0, 1) for x in (k, v))

    def _prefix_of(self, index: int, k: int) -> torch.Tensor | None:
        """Where each of GPU batch k's computed rows holds its copy of the shared prefix in
        block `index`; None where decode steps do not attend to the prefix apart (its slots
        then hold every position; where they hold the prefix out, its copy must be there)."""
        if not self._attends_to_prefix_apart(index):
            return None
        rows = self.step_rows[k].rows
        return self.prefix_start[k] if rows is None else self.prefix_start[k][rows.cpu()]

    def _decode_attention(self, slot: KVCacheSlot | KiviCacheSlot, cache: dict, qu, ku, vu, rows: StepRows,
                          window: int, index: int, prefix_start: torch.Tensor | None = None,
                          sinks: torch.Tensor | None = None):
        """Attention of one new position per computed unit, tier by tier, to the positions
        the slot holds and to itself; a sliding-window block's to its last `window` positions
        only (slot.decode_valid). Where attention reads a tier in place (never a ring, never
        compressed) the new keys and values are written first and the cache is read as a
        view; elsewhere they fill the column the loaded cache leaves for them. Returns the
        output and the tiers still to write. With prefix_start (block `index` attends to its
        shared prefix apart), each tier's units attend to the prefix's one copy and to the
        positions their slot holds outside it (attend_past_shared_prefix; a compressed cache's
        or sparse attention's: attend_past_held_prefix, the top-k over both). sinks: the units'
        attention sinks (unit_sinks), None where the model has none."""
        outs, unwritten = [], []
        for tier in TIERS:
            part, local = rows.tier_part(*slot.ranges[tier])
            if part.start == part.stop:
                continue
            where = self._attention_device(tier)
            new_k, new_v = ku[part].to(where), vu[part].to(where)
            part_sinks = None if sinks is None else sinks[part].to(where)
            drop, valid = slot.decode_valid(tier, self.length, window, rows.valid[part], local)
            if slot.in_place(tier, where):
                keys, values = slot.append_in_place(tier, new_k, new_v, self.length, local)
                if slot.rewrites_in_place(self.length):  # attended to as computed (as a compressed cache's
                    unwritten.append(tier)               # new column is), then written again: rounded
            else:
                unwritten.append(tier)
                kc, vc = slot.computed_rows(tier, *cache[tier], local)
                keys = _with_new(kc, new_k)[:, drop:]
                if vc is None:  # V left on disk: attend() asks for the rows it keeps
                    values = functools.partial(self._disk_values, slot, new_v, local,
                                               slot.first_held(self.length) + drop)
                else:
                    values = _with_new(vc, new_v)[:, drop:]
            if prefix_start is not None and self.prefix_as_stored:
                prefix_k, prefix_v = self._unpacked_prefix(index, where)
                own = self._own_keys(slot, rows, part, valid, where, prefix_start, prefix_k.shape[1])
                out = attend_past_held_prefix(qu[part].to(where), keys, values, own, prefix_k, prefix_v,
                                              first_unit=part.start, keep_fraction=self.policy.attn_sparsity,
                                              softcap=self.cfg.attn_softcap, sinks=part_sinks)
            elif prefix_start is not None:
                prefix = self.decode_prefix[index, where.type]
                own = self._own_keys(slot, rows, part, valid, where, prefix_start, prefix.length)
                out = attend_past_shared_prefix(qu[part].to(where), keys, values, own, prefix,
                                                first_unit=part.start, softcap=self.cfg.attn_softcap,
                                                sinks=part_sinks)
            else:
                out = attend(qu[part].to(where), keys, values, valid.to(where), causal=False,
                             keep_fraction=self.policy.attn_sparsity, softcap=self.cfg.attn_softcap,
                             sinks=part_sinks)
            outs.append(out.to(self.devices.compute, non_blocking=True))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)), tuple(unwritten)

    def _own_keys(self, slot: KVCacheSlot | KiviCacheSlot, rows: StepRows, part: slice, valid: torch.Tensor,
                  where: torch.device, prefix_start: torch.Tensor, prefix_len: int) -> torch.Tensor:
        """Which of a tier's keys (decode_valid's columns) each of its computed units may see
        outside its copy of the shared prefix (slot.outside_prefix), on `where`: made by the
        step's first layer whose tier holds these units and reused by the rest, whose slots
        hold the same positions (blocks that attend to the prefix apart have no window; a
        split cache may put different units on a tier from layer to layer)."""
        def make() -> torch.Tensor:
            unit_starts = prefix_start.cpu()[torch.arange(part.start, part.stop) // self.cfg.num_kv_heads]
            return slot.outside_prefix(valid.to(where), unit_starts, prefix_len)

        return rows.per_step(("own keys", part.start, part.stop, where.type, valid.shape[1], prefix_len), make)

    def _disk_values(self, slot: KVCacheSlot, new_v: torch.Tensor, local: torch.Tensor | None, first: int,
                     keys: list[int]) -> torch.Tensor:
        """V of the computed disk units (`local`, None: all) at sorted key indices `keys` (key
        i at position first + i), (units, n, d) on new_v's device; the last may be this
        step's token, whose V is not written yet."""
        t0 = time.perf_counter()
        positions = slot.positions_of(first, keys)
        cached = [p for p in positions if p < self.length]
        pieces = []
        if cached:
            stored = dense(slot.read_disk_values(cached).to(new_v.device), self.devices.dtype)
            if local is not None:
                stored = stored.index_select(1, local.to(stored.device))
            pieces.append(stored.transpose(0, 1))
        if len(cached) < len(positions):
            pieces.append(new_v)
        self.timers["decode_read_sparse_values"] += time.perf_counter() - t0
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def close(self) -> None:
        self.io.close()
        if self.kept is not None and self.kept is not self.rt.kept:  # the block's own copies, not the run's
            self.kept.release()
        for tier, nbytes in self._prefix_bytes:
            self.rt.usage.remove(tier, nbytes)
        self._prefix_bytes.clear()
        self.decode_prefix.clear()
        self._prefix_unpacked.clear()
        for slot in self.slots.values():
            slot.close()
        for a in self.acts:
            a.close()


def _with_new(loaded: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A loaded cache of the computed units (units, n + 1, d: slot.computed_rows) with their
    new token (units, 1, d) in its last column."""
    loaded[:, -1] = new[:, 0]
    return loaded
