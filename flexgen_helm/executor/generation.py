"""Generation and scoring over blocks: bucketing, padding, sampling, stopping."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from flexgen_helm.executor.sampling import Completion, SamplingParams, select_tokens
from flexgen_helm.executor.schedule import BlockSchedule, GpuBatch
from flexgen_helm.policy.policy import Policy


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
    text: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RunStats:
    sequences: int = 0
    prompt_tokens: int = 0
    padded_prompt_tokens: int = 0
    generated_tokens: int = 0
    padded_generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    blocks: int = 0
    timers: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def add_timers(self, timers: dict) -> None:
        for k, v in timers.items():
            self.timers[k] = self.timers.get(k, 0.0) + v

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["total_s"] = self.total_s
        return d


def plan_blocks(lengths: list[int], policy: Policy) -> list[list[list[int]]]:
    """Sequence indices grouped into blocks of GPU batches, sorted by length so that a
    block pads little. The last block may hold fewer or smaller GPU batches."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    blocks = []
    for start in range(0, len(order), policy.block_size):
        chunk = order[start:start + policy.block_size]
        blocks.append([chunk[i:i + policy.gpu_batch_size] for i in range(0, len(chunk), policy.gpu_batch_size)])
    return blocks


def left_pad(prompts: list[list[int]], length: int, pad_id: int) -> GpuBatch:
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), length), dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, length - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[r, length - len(p):] = True
    return GpuBatch(ids, valid)


class BlockRunner:
    """Runs blocks of sequences through a ModelRuntime under a policy."""

    def __init__(self, runtime, policy: Policy, decode_text, workdir: Path, stats: RunStats):
        self.rt, self.policy, self.decode_text, self.workdir, self.stats = runtime, policy, decode_text, workdir, stats
        self.pad_id = runtime.config.pad_token_id if runtime.config.pad_token_id is not None else 0

    def schedule(self, groups: list[list[list[int]]], max_len: int, name: str = "") -> BlockSchedule:
        """A schedule for GPU batches of prompts; schedules alive at once need distinct names
        (their disk files live in a folder of that name)."""
        workdir = self.workdir / name if name else self.workdir
        workdir.mkdir(exist_ok=True)
        length = max(len(p) for g in groups for p in g)
        batches = [left_pad(g, length, self.pad_id) for g in groups]
        real = sum(len(p) for g in groups for p in g)
        self.stats.prompt_tokens += real
        self.stats.padded_prompt_tokens += length * sum(len(g) for g in groups)
        self.stats.blocks += 1
        return BlockSchedule(self.rt, self.policy, batches, max_len, workdir)

    # ---- generation ------------------------------------------------------------------

    def generate(self, block: list[list[Sequence]]) -> None:
        longest = max(len(s.prompt) for g in block for s in g)
        steps = max(s.params.max_new_tokens for g in block for s in g)
        for s in (s for g in block for s in g):
            if s.params.max_new_tokens == 0:
                s.finish_reason = "length"
        if steps == 0:
            return
        sched = self.schedule([[s.prompt for s in g] for g in block], longest + steps)
        try:
            t0 = time.perf_counter()
            logprobs = sched.prefill(self.last_position_head)
            self.stats.prefill_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            for step in range(steps):
                tokens = [self.choose(g, lp) for g, lp in zip(block, logprobs)]
                self.stats.padded_generated_tokens += sum(len(g) for g in block)
                if step == steps - 1 or all(s.done for g in block for s in g):
                    break
                logprobs = sched.decode(tokens, self.last_position_head)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.add_timers(sched.timers)
        finally:
            sched.close()
        for s in (s for g in block for s in g):
            if not s.done:
                s.finish_reason = "length"

    def last_position_head(self, k: int, w: dict, h: torch.Tensor) -> torch.Tensor:
        logits = self.rt.family.head(self.rt.config, w, h[:, -1])
        return F.log_softmax(logits.float(), dim=-1).cpu()

    def choose(self, group: list[Sequence], logprobs: torch.Tensor) -> torch.Tensor:
        chosen = select_tokens(logprobs, [s.params for s in group], [s.generator for s in group])
        for r, s in enumerate(group):
            if s.done:
                continue
            token = int(chosen[r])
            if token in s.stop_ids:
                s.finish_reason = "stop"
                continue
            s.tokens.append(token)
            s.logprobs.append(float(logprobs[r, token]))
            self.stats.generated_tokens += 1
            if s.params.top_logprobs:
                top = logprobs[r].topk(s.params.top_logprobs)
                s.top.append({int(i): float(v) for v, i in zip(top.values, top.indices)})
            if s.params.stop_strings:
                self._check_stop_strings(s)
            if not s.done and len(s.tokens) >= s.params.max_new_tokens:
                s.finish_reason = "length"
        return chosen

    def _check_stop_strings(self, s: Sequence) -> None:
        text = self.decode_text(s.tokens)
        cut = min((i for i in (text.find(stop) for stop in s.params.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            s.text = text[:cut]
            s.finish_reason = "stop_string"

    # ---- scoring (echo) -----------------------------------------------------------------

    def score(self, prompts: list[list[int]], top_k: int, as_decode: bool,
              first_scored: list[int]) -> list[tuple[list[float], list[dict] | None]]:
        """Per prompt: log p(token_i | tokens_<i) for each token from first_scored[i] (>= 1)
        on (earlier tokens, the first always: nan, and no top entries); as_decode: see
        BlockSchedule.prefill."""
        groups = [list(range(i, min(i + self.policy.gpu_batch_size, len(prompts))))
                  for i in range(0, len(prompts), self.policy.gpu_batch_size)]
        sched = self.schedule([[prompts[i] for i in g] for g in groups], max(len(p) for p in prompts))
        length = sched.batches[0].ids.shape[1]
        # column c of a left-padded row predicts its token c + 1
        wanted = [torch.arange(length - 1)[None, :] >= torch.tensor(
            [length - len(prompts[i]) + first_scored[i] - 1 for i in g])[:, None] for g in groups]
        try:
            t0 = time.perf_counter()
            per_batch = sched.prefill(
                lambda k, w, h: self._scored_positions_head(sched.batches[k], w, h, top_k, wanted[k]),
                as_decode=as_decode)
            self.stats.prefill_s += time.perf_counter() - t0
            self.stats.add_timers(sched.timers)
        finally:
            sched.close()
        out = []
        for g, (lps, tops) in zip(groups, per_batch):
            for r, i in enumerate(g):
                n = len(prompts[i])
                row = [math.nan] + lps[r, length - n:].tolist()
                top = [{}] + tops[r][length - n:] if tops is not None else None
                out.append((row, top))
        return out

    def _scored_positions_head(self, batch: GpuBatch, w: dict, h: torch.Tensor, top_k: int, wanted: torch.Tensor,
                               rows_per_chunk: int = 256):
        """Log-probs of the wanted next tokens ((b, s-1) mask), through the head a chunk of
        positions at a time: padding and unwanted positions never reach the vocabulary-wide
        head, and the (positions x vocabulary) logits never exist all at once."""
        b, s = batch.ids.shape
        mask = wanted.to(h.device)
        hidden = h[:, :-1][mask]  # (n, hidden)
        targets = batch.ids[:, 1:].to(h.device)[mask]
        picked = torch.empty(len(targets))
        top_vals, top_ids = [], []
        for c0 in range(0, len(targets), rows_per_chunk):
            c1 = min(c0 + rows_per_chunk, len(targets))
            logits = self.rt.family.head(self.rt.config, w, hidden[None, c0:c1])[0].float()
            norm = torch.logsumexp(logits, dim=-1)
            picked[c0:c1] = (logits.gather(-1, targets[c0:c1, None])[:, 0] - norm).cpu()
            if top_k:
                vals, idx = logits.topk(top_k, dim=-1)
                top_vals.append((vals - norm[:, None]).cpu())
                top_ids.append(idx.cpu())
        lps = torch.full((b, s - 1), math.nan)
        lps[wanted] = picked
        if not top_k:
            return lps, None
        tops = [[{} for _ in range(s - 1)] for _ in range(b)]
        rows, cols = wanted.nonzero(as_tuple=True)
        for r, c, vals, idx in zip(rows.tolist(), cols.tolist(), torch.cat(top_vals or [torch.empty(0, top_k)]).tolist(),
                                   torch.cat(top_ids or [torch.empty(0, top_k, dtype=torch.long)]).tolist()):
            tops[r][c] = dict(zip(idx, vals))
        return lps, tops


def to_completion(s: Sequence, decode_text) -> Completion:
    text = s.text if s.text is not None else decode_text(s.tokens)
    return Completion(text=text, token_ids=list(s.tokens), logprobs=list(s.logprobs),
                      top_logprobs=list(s.top) if s.params.top_logprobs else None,
                      finish_reason=s.finish_reason or "length")
