"""The block driver: generation and scoring over blocks (bucketing, padding, the token
steps, sampling, stopping). The single-process Engine and every pipeline stage run this
one driver; a pipeline stage plugs in through a `StageLink` (where a step's inputs come
from and where its outputs go)."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from flexgen_helm.executor.length_buckets import cut_by_length
from flexgen_helm.executor.sampling import Completion, RunStats, SamplingParams, ScoreResult, select_tokens
from flexgen_helm.executor.schedule import BlockSchedule, GpuBatch
from flexgen_helm.executor.shared_prefix import SharedPrefix, common_prefix_len, shared_prefix_len
from flexgen_helm.memory.copy_engine import without_autograd
from flexgen_helm.policy.policy import Policy

__all__ = ["BlockDriver", "LocalStage", "RunStats", "Sequence", "StageLink", "StepCallback", "left_pad",
           "plan_blocks"]

# a scored prompt's positions go through the vocabulary-wide head this many at a time, so
# that its (positions x vocabulary) logits never exist all at once
SCORED_ROWS_PER_HEAD_CALL = 256


@dataclass
class Sequence:
    """One completion being generated: a prompt with its own params and random stream."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> Completion:
        return Completion(token_ids=list(self.tokens), logprobs=list(self.logprobs),
                          top_logprobs=list(self.top) if self.params.top_logprobs else None,
                          finish_reason=self.finish_reason or "length")


def plan_blocks(lengths: list[int], policy: Policy) -> list[list[list[int]]]:
    """Sequence indices grouped into blocks of GPU batches, longest first: sorted by length,
    block_size sequences to a block (the last may hold fewer), each block cut into the fewest
    GPU batches of at most gpu_batch_size whose padding (each is padded to its own longest
    prompt) stays within PAD_TOLERANCE. Prompts of one length run in the policy's shape:
    num_gpu_batches full GPU batches a block."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks = []
    for first in range(0, len(order), policy.block_size):
        chunk = order[first:first + policy.block_size][::-1]  # shortest first, as cut_by_length takes them
        cuts = cut_by_length([lengths[i] for i in chunk], policy.gpu_batch_size)
        blocks.append([chunk[start:end][::-1] for start, end in reversed(cuts)])
    return blocks


# on_step(done, total): token steps done and planned over all of a generate call's blocks
# (step 1 of a block is its prefill); called after each step, from the generating thread
StepCallback = Callable[[int, int], None]


def block_steps(block: list[list[Sequence]]) -> int:
    """Token steps of a block: its longest max_new_tokens (the prefill makes the first token)."""
    return max(s.params.max_new_tokens for g in block for s in g)


def left_pad(prompts: list[list[int]], length: int, pad_id: int) -> GpuBatch:
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), length), dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, length - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[r, length - len(p):] = True
    return GpuBatch(ids, valid)


# A block's GPU batches of sequences, split into micro-batches (see StageLink.micro_batches)
Block = list[list[Sequence]]


class StageLink(Protocol):
    """How the driver's token steps meet the rest of the model.

    A runtime that holds the whole model (`LocalStage`) feeds each step the tokens it chose
    at the step before. A pipeline stage (dist/pipeline.py) holds some layers: it receives
    a step's inputs from the stage before it and sends its outputs on."""

    # holds the head: the driver chooses tokens from this stage's outputs
    samples: bool
    # may skip a block's remaining steps once all its sequences are done (every stage of a
    # pipeline must run the same steps, and only the last one knows)
    stops_early: bool

    def micro_batches(self, block: Block) -> list[Block]:
        """The block split into groups that have a schedule each and take turns per step."""

    def step_input(self, group: Block, sched: BlockSchedule, step: int,
                   chosen: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Per GPU batch of `group`: the token ids (b,) or hidden states (b, s, hidden) that
        `step` runs on; None at step 0 where the prompts' token ids are the input. `chosen`:
        the tokens this driver chose for the group at the step before (None where it does not
        sample, and at step 0)."""

    def step_output(self, outputs: list[torch.Tensor], more_steps: bool) -> None:
        """What `step` produced per GPU batch: the chosen tokens where this stage samples,
        else its hidden states. more_steps: another step follows."""

    def prefix_input(self, length: int) -> torch.Tensor | None:
        """A block's shared prefix (executor/shared_prefix.py) as the stage before hands it on:
        its hidden states (1, length, hidden) after that stage's layers; None where this
        stage embeds the prefix's tokens itself. Asked before the block's first micro-batch's
        step_input at the prefill."""

    def prefix_output(self, hidden: torch.Tensor) -> None:
        """The shared prefix's hidden states (1, length, hidden) after this stage's layers,
        for the stage after (nothing where this stage holds the head). Given after the block's
        first micro-batch's prefill, before its step_output."""

    def drain(self) -> None:
        """Wait until every output handed on has left (at the end of a block)."""


class LocalStage:
    """The whole model in this process: a step's input is the tokens chosen at the step
    before, which the driver keeps itself, so nothing travels."""

    samples = True
    stops_early = True

    def micro_batches(self, block: Block) -> list[Block]:
        return [block]

    def step_input(self, group: Block, sched: BlockSchedule, step: int,
                   chosen: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        return chosen

    def step_output(self, outputs: list[torch.Tensor], more_steps: bool) -> None:
        """Nothing to send: the driver feeds the chosen tokens back itself."""

    def prefix_input(self, length: int) -> torch.Tensor | None:
        return None  # the embedding is here

    def prefix_output(self, hidden: torch.Tensor) -> None:
        """Nothing to send: the head is here."""

    def drain(self) -> None:
        """Nothing was sent."""


class BlockDriver:
    """Runs sequences through a ModelRuntime under a policy, block after block."""

    def __init__(self, runtime, policy: Policy, workdir: Path, stats: RunStats, link: StageLink | None = None,
                 on_step: StepCallback | None = None):
        self.rt, self.policy, self.workdir, self.stats = runtime, policy, workdir, stats
        self.link = link if link is not None else LocalStage()
        self.on_step = on_step
        self._steps_done = self._steps_total = 0
        self.pad_id = runtime.config.pad_token_id if runtime.config.pad_token_id is not None else 0

    def start_block(self, groups: list[list[list[int]]], last_shared: list[int] | None,
                    micro_batches: int = 1) -> SharedPrefix | None:
        """Counts a block's prompt tokens (its GPU batches' prompts, each batch padded to its
        longest) in the stats, and gives the prefix it computes once, or None. last_shared
        (one per prompt, in order): the most of its first tokens each prompt may share with
        the others (shared_prefix_len); None: none. micro_batches: the schedules the block
        runs as (StageLink.micro_batches), which share the prefix.

        Every stage of a pipeline holds the block's prompts and policy, so each decides the
        same prefix here and counts the same tokens."""
        lengths = [max(map(len, g)) for g in groups]
        shared = shared_prefix_len(groups, last_shared) if last_shared is not None and self.policy.prefix_sharing \
            else 0
        self.stats.prompt_tokens += sum(len(p) for g in groups for p in g)
        self.stats.padded_prompt_tokens += sum(n * len(g) for n, g in zip(lengths, groups))
        self.stats.computed_prompt_tokens += shared + sum((n - shared) * len(g) for n, g in zip(lengths, groups))
        self.stats.blocks += 1
        if not shared:
            return None
        return SharedPrefix(torch.tensor(groups[0][0][:shared], device=self.rt.devices.compute)[None], micro_batches)

    def schedule(self, groups: list[list[list[int]]], max_len: int, name: str = "",
                 head_rows: int | None = None, prefix: SharedPrefix | None = None) -> BlockSchedule:
        """A schedule for GPU batches of prompts, each padded to its own longest; schedules
        alive at once need distinct names (their disk files live in a folder of that name);
        head_rows: see BlockSchedule; prefix: the block's (start_block)."""
        workdir = self.workdir / name if name else self.workdir
        workdir.mkdir(exist_ok=True)
        batches = [left_pad(g, max(map(len, g)), self.pad_id) for g in groups]
        return BlockSchedule(self.rt, self.policy, batches, max_len, workdir, head_rows, shared_prefix=prefix)

    # ---- generation ------------------------------------------------------------------

    def generate(self, seqs: list[Sequence]) -> None:
        """Generate every sequence, in blocks of similar prompt length."""
        without_autograd(self._generate, seqs)

    def _generate(self, seqs: list[Sequence]) -> None:
        blocks = [[[seqs[i] for i in group] for group in block]
                  for block in plan_blocks([len(s.prompt) for s in seqs], self.policy)]
        self._steps_total = sum(block_steps(block) for block in blocks)
        for block in blocks:
            self.generate_block(block)

    def generate_block(self, block: Block) -> None:
        for s in (s for g in block for s in g):
            if s.params.max_new_tokens == 0:
                s.finish_reason = "length"
        steps = block_steps(block)
        if steps == 0:
            return
        longest = max(len(s.prompt) for g in block for s in g)
        groups = self.link.micro_batches(block)
        prefix = self.start_block([[s.prompt for s in batch] for batch in block],
                                  [len(s.prompt) - 1 for batch in block for s in batch], len(groups))
        scheds = [self.schedule([[s.prompt for s in batch] for batch in group], longest + steps, name=f"group-{g}",
                                prefix=prefix)
                  for g, group in enumerate(groups)]
        done_before = self._steps_done
        try:
            self._run_steps(block, groups, scheds, steps, prefix)
        finally:
            self.link.drain()
            for sched in scheds:
                self.stats.add_timers(sched.timers)
                sched.close()
        for s in (s for g in block for s in g):
            if not s.done:
                s.finish_reason = "length"
        self._step_done(done_before + steps)  # the steps an early stop skipped count as done

    def _step_done(self, done: int) -> None:
        if done != self._steps_done:
            self._steps_done = done
            if self.on_step is not None:
                self.on_step(done, max(self._steps_total, done))

    def _run_steps(self, block: Block, groups: list[Block], scheds: list[BlockSchedule], steps: int,
                   prefix: SharedPrefix | None = None) -> None:
        """Step 0 is the prefill, every later step one decode; within a step the groups take
        turns (in a pipeline, stage s runs group g while stage s+1 runs group g-1). The
        block's shared prefix (if any) runs with the first group's prefill, and travels
        between stages ahead of that group's windows.

        Where the driver knows which sequences are done (it stops early), a finished
        sequence leaves its GPU batch's compute from the next step on (compute_only): the
        block decodes to its longest max_tokens, but only the unfinished rows cost work."""
        head = self.last_position_head if self.link.samples else None
        chosen: list[list[torch.Tensor] | None] = [None] * len(groups)
        computing = [[list(range(len(batch))) for batch in group] for group in groups]  # rows per GPU batch
        t0 = time.perf_counter()
        for step in range(steps):
            if step > 0 and self.link.stops_early and all(s.done for g in block for s in g):
                break
            for g, (group, sched) in enumerate(zip(groups, scheds)):
                carries_prefix = prefix is not None and step == 0 and g == 0
                if carries_prefix:
                    self._receive_prefix(prefix)
                inputs = self.link.step_input(group, sched, step, chosen[g])
                outputs = sched.prefill(head, hidden=inputs, decode_follows=steps > 1) if step == 0 \
                    else sched.decode(inputs, head)
                if carries_prefix:
                    self.link.prefix_output(prefix.hidden)
                if self.link.samples:
                    outputs = chosen[g] = [self.choose(batch, lp, rows)
                                           for batch, lp, rows in zip(group, outputs, computing[g])]
                    self.stats.padded_generated_tokens += sum(map(len, computing[g]))
                self.link.step_output(outputs, more_steps=step + 1 < steps)
                if self.link.stops_early:
                    for k, batch in enumerate(group):
                        computing[g][k] = [r for r, s in enumerate(batch) if not s.done]
                        sched.compute_only(k, computing[g][k])
            if step == 0:
                self.stats.prefill_s += time.perf_counter() - t0
            self._step_done(self._steps_done + 1)
            if step == 0:
                t0 = time.perf_counter()
        self.stats.decode_s += time.perf_counter() - t0

    def _receive_prefix(self, prefix: SharedPrefix) -> None:
        """Where the stage before computed the prefix's first layers, start from its output."""
        hidden = self.link.prefix_input(prefix.length)
        if hidden is not None:
            prefix.start_from(hidden.to(self.rt.devices.compute))

    def last_position_head(self, k: int, w: dict, h: torch.Tensor) -> torch.Tensor:
        logits = self.rt.family.head(self.rt.config, w, h[:, -1])
        return F.log_softmax(logits, dim=-1, dtype=torch.float32).cpu()

    def choose(self, group: list[Sequence], logprobs: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
        """The next token of every sequence of a GPU batch, (b,): logprobs has a row for each
        of `rows` (the rows computed at this step, None where none was); the others get the
        pad id, which no step computes on."""
        chosen = torch.full((len(group),), self.pad_id, dtype=torch.long)
        if not rows:
            return chosen
        picked = [group[r] for r in rows]
        chosen[rows] = select_tokens(logprobs, [s.params for s in picked], [s.generator for s in picked])
        for i, (r, s) in enumerate(zip(rows, picked)):
            if s.done:
                continue
            token = int(chosen[r])
            if token in s.stop_ids:
                s.finish_reason = "stop"
                continue
            s.tokens.append(token)
            s.logprobs.append(float(logprobs[i, token]))
            self.stats.generated_tokens += 1
            if s.params.top_logprobs:
                top = logprobs[i].topk(s.params.top_logprobs)
                s.top.append({int(i): float(v) for v, i in zip(top.values, top.indices)})
            if s.params.stop is not None and s.params.stop.reached(s.tokens):
                s.finish_reason = "stop_condition"
            elif len(s.tokens) >= s.params.max_new_tokens:
                s.finish_reason = "length"
        return chosen

    # ---- scoring (echo) -----------------------------------------------------------------

    def score(self, prompts: list[list[int]], top_k: int, as_decode: bool,
              first_scored: list[int]) -> list[ScoreResult]:
        """One ScoreResult per prompt, in order (see score_block), in blocks of similar length."""
        return without_autograd(self._score, prompts, top_k, as_decode, first_scored)

    def _score(self, prompts: list[list[int]], top_k: int, as_decode: bool,
               first_scored: list[int]) -> list[ScoreResult]:
        out: list[ScoreResult | None] = [None] * len(prompts)
        for block in plan_blocks([len(p) for p in prompts], self.policy):
            flat = [i for group in block for i in group]
            scored = self.score_block([prompts[i] for i in flat], top_k, as_decode, [first_scored[i] for i in flat],
                                      [len(group) for group in block])
            for i, (lps, top) in zip(flat, scored):
                out[i] = ScoreResult(token_ids=prompts[i], logprobs=lps, top_logprobs=top)
        return out

    def score_block(self, prompts: list[list[int]], top_k: int, as_decode: bool,
                    first_scored: list[int], batch_sizes: list[int]) -> list[tuple[list[float], list[dict] | None]]:
        """Per prompt: log p(token_i | tokens_<i) for each token from first_scored[i] (>= 1)
        on (earlier tokens, the first always: nan, and no top entries); the prompts make GPU
        batches of `batch_sizes`, in order; as_decode: see BlockSchedule.prefill."""
        ends = list(itertools.accumulate(batch_sizes))
        groups = [list(range(end - size, end)) for size, end in zip(batch_sizes, ends)]
        lengths = [max(len(prompts[i]) for i in g) for g in groups]
        # column c of a left-padded row predicts its token c + 1
        wanted = [torch.arange(length - 1)[None, :] >= torch.tensor(
            [length - len(prompts[i]) + first_scored[i] - 1 for i in g])[:, None] for g, length in zip(groups, lengths)]
        head_rows = min(SCORED_ROWS_PER_HEAD_CALL, max(int(m.sum()) for m in wanted))
        # A shared prefix stops a token short of the prompts' common one: every position it
        # holds then predicts a token all prompts share, scored once for all (_shared_positions_head).
        # as_decode attends position by position as the cache returns it: no shared prefix there.
        common = common_prefix_len(prompts)
        batches = [[prompts[i] for i in g] for g in groups]
        prefix = self.start_block(batches, None if as_decode else [min(len(p), common) - 1 for p in prompts])
        sched = self.schedule(batches, max(len(p) for p in prompts), head_rows=head_rows, prefix=prefix)
        shared_scores = []

        def head(k: int, w: dict, h: torch.Tensor):
            if prefix is not None and not shared_scores:  # the first GPU batch's head: the prefix's too
                shared_scores.append(self._shared_positions_head(w, prefix.hidden[0], prompts[0],
                                                                 min(first_scored) - 1, top_k))
            return self._scored_positions_head(sched.batches[k], w, h, top_k, wanted[k],
                                               shared_scores[0] if shared_scores else None)

        try:
            t0 = time.perf_counter()
            per_batch = sched.prefill(head, as_decode=as_decode, decode_follows=False)
            self.stats.prefill_s += time.perf_counter() - t0
            self.stats.add_timers(sched.timers)
        finally:
            sched.close()
        out = []
        for g, length, (lps, tops) in zip(groups, lengths, per_batch):
            for r, i in enumerate(g):
                n = len(prompts[i])
                row = [math.nan] + lps[r, length - n:].tolist()
                top = [{}] + tops[r][length - n:] if tops is not None else None
                out.append((row, top))
        return out

    def _scored_positions_head(self, batch: GpuBatch, w: dict, h: torch.Tensor, top_k: int, wanted: torch.Tensor,
                               shared: tuple | None = None, rows_per_chunk: int = SCORED_ROWS_PER_HEAD_CALL):
        """Log-probs of the wanted next tokens ((b, s-1) mask), through the head a chunk of
        positions at a time: padding and unwanted positions never reach the vocabulary-wide
        head, and the (positions x vocabulary) logits never exist all at once.

        h holds the batch's last columns only where a shared prefix was computed once
        (BlockSchedule.window); the columns before them are the prefix's positions, whose
        log-probs and top entries (`shared`, _shared_positions_head) every row takes at its
        own offset."""
        b, s = batch.ids.shape
        first = s - h.shape[1]  # columns before the ones computed: a shared prefix's
        computed = wanted.clone()
        computed[:, :first] = False
        mask = computed[:, first:].to(h.device)
        hidden = h[:, :-1][mask]  # (n, hidden)
        targets = batch.ids[:, first + 1:].to(h.device)[mask]
        picked = torch.empty(len(targets))
        top_vals, top_ids = [], []
        for c0 in range(0, len(targets), rows_per_chunk):
            c1 = min(c0 + rows_per_chunk, len(targets))
            logprobs = self._head_logprobs(w, hidden[c0:c1])
            picked[c0:c1] = logprobs.gather(-1, targets[c0:c1, None])[:, 0].cpu()
            if top_k:
                vals, idx = logprobs.topk(top_k, dim=-1)
                top_vals.append(vals.cpu())
                top_ids.append(idx.cpu())
        lps = torch.full((b, s - 1), math.nan)
        lps[computed] = picked
        # the prefix's columns: row r's prefix position of column c is c - (its padding)
        before = wanted[:, :first]
        position = (torch.arange(first)[None, :] - (~batch.valid).sum(1)[:, None])[before]
        if len(position):
            lps[:, :first][before] = shared[0][position]
        if not top_k:
            return lps, None
        tops = [[{} for _ in range(s - 1)] for _ in range(b)]
        rows, cols = computed.nonzero(as_tuple=True)
        all_vals = torch.cat(top_vals or [torch.empty(0, top_k)]).tolist()
        for r, c, vals, idx in zip(rows.tolist(), cols.tolist(), all_vals,
                                   torch.cat(top_ids or [torch.empty(0, top_k, dtype=torch.long)]).tolist()):
            tops[r][c] = dict(zip(idx, vals))
        for (r, c), i in zip(before.nonzero().tolist(), position.tolist()):
            tops[r][c] = shared[1][i]
        return lps, tops

    def _head_logprobs(self, w: dict, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) -> (n, vocabulary) float32 log-probs."""
        # by one log_softmax: a float copy of the logits, then logsumexp's passes over it (max,
        # subtract, exp, sum), read and wrote them several times more
        return F.log_softmax(self.rt.family.head(self.rt.config, w, hidden[None])[0], dim=-1, dtype=torch.float32)

    def _shared_positions_head(self, w: dict, hidden: torch.Tensor, prompt: list[int], first: int, top_k: int,
                               rows_per_chunk: int = SCORED_ROWS_PER_HEAD_CALL) -> tuple[torch.Tensor, list]:
        """A shared prefix's positions through the head once for every prompt of the block:
        hidden (n, hidden) predicts prompt[1:n + 1] (tokens every prompt shares). Per position,
        the log-prob of its next token and its top_k entries; nan and {} before `first`, a
        position no prompt scores."""
        n = hidden.shape[0]
        lps, tops = torch.full((n,), math.nan), [{} for _ in range(n)]
        targets = torch.tensor(prompt[1:n + 1], device=hidden.device)
        for c0 in range(max(0, first), n, rows_per_chunk):
            c1 = min(c0 + rows_per_chunk, n)
            logprobs = self._head_logprobs(w, hidden[c0:c1])
            lps[c0:c1] = logprobs.gather(-1, targets[c0:c1, None])[:, 0].cpu()
            if top_k:
                vals, idx = logprobs.topk(top_k, dim=-1)
                for i, (v, j) in enumerate(zip(vals.tolist(), idx.tolist())):
                    tops[c0 + i] = dict(zip(j, v))
        return lps, tops
