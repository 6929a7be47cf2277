"""A block's shared prompt prefix, computed once per layer for all of its sequences.

HELM puts the same instructions and in-context examples in front of every prompt of a
run (and scores every answer choice, and samples every one of n outputs, after the same
question), so most of a few-shot block's prompt tokens are the same tokens at the same
positions. Their keys, values and hidden states do not depend on what follows them
(attention is causal), so the block computes them once, as a one-sequence batch, at each
layer just before its GPU batches.

The cache layout does not change: every sequence is still its whole prompt, left-padded,
in its GPU batch's columns. A GPU batch's prefill computes only its last columns (the
`window`: as many as its longest prompt has after the prefix), and takes the keys and
values of the columns before the window from the shared prefix, each row's at its own
offset. A row shorter than the batch's longest thus recomputes the last few tokens of its
prefix inside the window, as it would without sharing.

Decode steps then hold the prefix once too (schedule.py): a global block's slots leave out
the positions every row's copy covers (kv_cache.py; under KIVI grouping, whose groups count
from a row's first real token, the prefix's complete groups, kivi_cache.py), and attention
reads them from the block's one copy, for the queries of all its sequences at once: as
computed (attention.DecodePrefix), or, under cache compression or sparse attention, stored
as the slots store it (held_prefix.py), so that every row sees the values its own copy would
have given and sparse attention's top-k ranks the same keys. What a decode step attends to
is the cache it attended to without sharing; only rounding differs (the prefix's matmuls run
with one row instead of many, and its attention merges parts).

In a pipeline (dist/pipeline.py) every stage decides the same prefix from the block's
prompts, which every stage holds, and a block runs as micro-batches, one schedule each,
taking turns: the first micro-batch's prefill runs the prefix through each of the stage's
layers, and the later ones take that layer's keys and values, so that each stage computes
the prefix once per block, as one process does (each layer's prefix keys and values are
kept until the stage's last micro-batch has run that layer's prefill). A stage after the
first starts the prefix from the hidden states the stage before hands on (after its last
layer) ahead of its GPU batches' windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flexgen_helm.executor.attention import (
    attend,
    attend_window_past_shared_prefix,
    from_units,
    prefix_for_decode,
    to_units,
    unit_sinks,
)
from flexgen_helm.models.spec import SINKS

# Fewer shared tokens than this are not worth a second code path: the suffix attention
# takes a masked kernel where a plain prompt's has the left-padded causal one.
MIN_SHARED_TOKENS = 16
# ... nor a prefix that saves less than this share of the block's padded prompt tokens
MIN_SAVED_SHARE = 0.1


def common_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with."""
    first, n = prompts[0], min(map(len, prompts))
    for other in prompts[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


def shared_prefix_len(batches: list[list[list[int]]], last_shared: list[int]) -> int:
    """Prompt tokens a block (its GPU batches' prompts, each batch padded to its longest)
    computes once for all, or 0 where sharing does not pay.

    last_shared[i] (the block's prompts in order): prompt i shares at most its first
    last_shared[i] tokens, so that its window holds every position whose hidden state the
    head reads (the last one; a scored prompt's, from its first scored on)."""
    prompts = [p for batch in batches for p in batch]
    if len(prompts) < 2:
        return 0
    shared = min(common_prefix_len(prompts), *last_shared)
    lengths = [max(map(len, batch)) for batch in batches]
    padded = sum(length * len(batch) for length, batch in zip(lengths, batches))
    computed = shared + sum((length - shared) * len(batch) for length, batch in zip(lengths, batches))
    if shared < MIN_SHARED_TOKENS or padded - computed < MIN_SAVED_SHARE * padded:
        return 0
    return shared


@dataclass
class PrefixLayer:
    """The shared prefix at one transformer block: its keys and values (kv_heads, length,
    head_dim), and the layout decode steps read them in, by the device type where they
    attend (BlockSchedule), converted once for every micro-batch of the block."""

    keys: torch.Tensor
    values: torch.Tensor
    decode: dict = field(default_factory=dict)  # device type -> attention.DecodePrefix or held_prefix.HeldPrefix
    # (positions, device type, dtype, softcap) -> DecodePrefix of the first positions (attend_window)
    _heads: dict = field(default_factory=dict)
    _led: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values led by zeros (with_context)

    def with_context(self, pad: torch.Tensor, own_keys: torch.Tensor, own_values: torch.Tensor,
                     unread: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
        """A GPU batch's keys and values over its columns, (b * kv_heads, width + s, head_dim):
        the shared prefix's columns before its window (width = the prefix's length), then its
        own (b * kv_heads, s, head_dim). Row r's prefix starts after its `pad[r]` padding
        columns (zeros there: padding is never a valid key). Gathered from the prefix led by
        `width` zero positions, straight into the joined tensor: a masked copy, a reshape and a
        concatenation fewer, bit for bit the same (the induction scenario's prefill spent
        ~11% in them: runs/prefix_sharing/README.md). Columns [unread[0], unread[1]) are left
        unmade, for a caller that reads none of them (attend_window, and a slot that holds them
        out: KVCacheSlot.ignores_writes_to): copying every row's copy of the prefix was a fifth
        of a few-shot block's prefill (runs/prefix_sharing/README.md)."""
        kvh, width, d = self.keys.shape
        b, s = len(pad), own_keys.shape[1]
        made = [(0, width)]  # the prefix's columns made: [a, z) ranges
        if unread[0] < unread[1]:
            made = [(a, z) for a, z in ((0, unread[0]), (unread[1], width)) if a < z]

        def joined(led: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
            out = own.new_empty(b, kvh, width + s, d)
            for a, z in made:
                index = (torch.arange(a, z, device=self.keys.device)[None, :]
                         + (width - pad.to(self.keys.device))[:, None]).clamp(min=0).flatten()  # (b * (z - a),)
                out[:, :, a:z] = led.index_select(0, index).view(b, z - a, kvh, d).transpose(1, 2)
            out[:, :, width:] = own.view(b, kvh, s, d)
            return out.view(b * kvh, width + s, d)

        if self._led is None:  # made once for every GPU batch of the block: (2 * width, kv_heads, d)
            self._led = tuple(torch.cat([x.new_zeros(kvh, width, d), x], 1).transpose(0, 1).contiguous()
                              for x in (self.keys, self.values))
        return joined(self._led[0], own_keys), joined(self._led[1], own_values)

    def window_split(self, pad: torch.Tensor, device: torch.device) -> int | None:
        """The prefix positions [0, split) that every row of a GPU batch with these paddings
        holds in its columns (all but the last max(pad)), which attend_window reads as the one
        copy; None where it does not (attend() over the joined columns)."""
        split = self.keys.shape[1] - int(pad.max())
        return split if torch.device(device).type == "cpu" and split >= MIN_SHARED_TOKENS else None

    def attend_window(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pad: torch.Tensor,
                      split: int, key_valid: torch.Tensor, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A global block's prefill attention of a GPU batch's window queries q (b * kv_heads,
        r, s, d) over its joined keys and values (with_context's) and key_valid (b * kv_heads,
        width + s), with the prefix's positions [0, split) that every row's columns hold
        (window_split) as one copy that every row's queries see whole
        (attention.attend_window_past_shared_prefix), the rest per row. On a CPU only (the
        caller asks window_split): a GPU's fused kernel reads the joined columns at its memory's
        speed, and this path has not run there."""
        kvh, width, d = self.keys.shape
        tail = width - split
        key = (split, q.device.type, q.dtype, softcap)
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = prefix_for_decode(self.keys[:, :split], self.values[:, :split], q.device,
                                                        q.dtype, softcap, use="window")
        # window column c < tail holds prefix position split + c - pad: the one copy's, where below split
        unit_pad = pad.to(q.device).repeat_interleave(kvh)
        valid = key_valid[:, split:].clone()
        valid[:, :tail] &= torch.arange(tail, device=q.device)[None, :] >= unit_pad[:, None]
        return attend_window_past_shared_prefix(q, keys[:, split:], values[:, split:], valid, head, softcap, sinks)


class SharedPrefix:
    """A block's shared prefix while its prefills walk the layers: its hidden state after
    the last layer run, and what each layer made of it for the micro-batches still to run
    that layer.

    ids (1, length) on the compute device; micro_batches: the schedules the block's GPU
    batches are split into (one in a single process), each of which asks for every layer."""

    def __init__(self, ids: torch.Tensor, micro_batches: int = 1):
        self.ids = ids
        self.micro_batches = micro_batches
        # before the first layer: None where the runtime embeds the tokens; a pipeline stage
        # after the first sets the stage before's output here (start_from)
        self.hidden: torch.Tensor | None = None
        self._kept: dict[str, tuple[PrefixLayer | None, int]] = {}  # layer name -> (its result, askers to come)

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def start_from(self, hidden: torch.Tensor) -> None:
        """The prefix's hidden states (1, length, hidden) after the layers before this runtime's."""
        if hidden.shape[:2] != (1, self.length):
            raise ValueError(f"a shared prefix of {self.length} tokens cannot start from hidden states of shape "
                             f"{tuple(hidden.shape)}")
        self.hidden = hidden

    def run_layer(self, family, cfg, layer, w: dict, at) -> PrefixLayer | None:
        """The prefix through one layer, once for the block: the first micro-batch to ask runs
        it, the others get what it made (kept until the last has asked). `at`:
        family.step_constants at positions 0..length-1. Returns the layer's keys and values
        (a transformer block), else None (the head's output is nobody's: skipped)."""
        if layer.name in self._kept:
            made, askers = self._kept.pop(layer.name)
            if askers > 1:
                self._kept[layer.name] = (made, askers - 1)
            return made
        made = self._run(family, cfg, layer, w, at)
        if self.micro_batches > 1:
            self._kept[layer.name] = (made, self.micro_batches - 1)
        return made

    def _run(self, family, cfg, layer, w: dict, at) -> PrefixLayer | None:
        if layer.kind == "embed":
            positions = torch.arange(self.length, device=self.ids.device)[None]
            self.hidden = family.embed(cfg, w, self.ids, positions)
            return None
        if layer.kind != "block":
            return None
        if self.hidden is None:
            raise ValueError("a shared prefix after the embedding starts from the stage before's hidden states "
                             "(start_from), and none were given")
        q, k, v = family.qkv(cfg, w, self.hidden, at, layer.index)
        kvh, d = cfg.num_kv_heads, k.shape[-1]
        made = PrefixLayer(k.reshape(kvh, self.length, d), v.reshape(kvh, self.length, d))
        valid = torch.ones(kvh, self.length, dtype=torch.bool, device=k.device)
        out = attend(to_units(q, kvh), made.keys, made.values, valid, causal=True, window=cfg.window(layer.index),
                     softcap=cfg.attn_softcap, sinks=unit_sinks(w.get(SINKS), kvh, 0, kvh))
        self.hidden = family.finish_block(cfg, w, self.hidden, from_units(out, 1))
        return made
