"""Per-request generation parameters and outputs (plain data), and token selection.

The engine works on token ids only: text, and stop strings, belong to the frontends
(flexgen_helm.text). A frontend ends a sequence on something other than a token id by
giving it a `StopCondition`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StopCondition(Protocol):
    """Ends one sequence early (e.g. at a stop string: flexgen_helm.text.StopStrings).

    The engine calls it with a sequence's generated token ids after every new token; once it
    answers True the sequence is done, with finish_reason "stop_condition" and every token
    generated so far (the frontend cuts what the condition matched)."""

    def reached(self, token_ids: Sequence[int]) -> bool: ...


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # the model's EOS is added unless ignore_eos
    stop: StopCondition | None = None  # ends a sequence on what token ids alone cannot say
    num_completions: int = 1
    top_logprobs: int = 0  # how many alternatives to return per generated token
    ignore_eos: bool = False

    def validate(self) -> None:
        from flexgen_helm.errors import FlexGenError

        if self.max_new_tokens < 0:
            raise FlexGenError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise FlexGenError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FlexGenError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FlexGenError(f"top_k must be >= 0 (0: no top-k filter), got {self.top_k}")
        if self.num_completions < 1:
            raise FlexGenError(f"num_completions must be >= 1, got {self.num_completions}")


@dataclass
class Completion:
    token_ids: list[int]  # every generated token (an EOS or stop token id is not one)
    logprobs: list[float]  # log p(token) under the model (before temperature / top-p)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "length"  # "length", "stop" (EOS or stop token id) or "stop_condition"


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


@dataclass
class ScoreResult:
    """log p(token_i | tokens_<i) for every prompt token; the first has no context: nan."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class RunStats:
    """What one engine call did: real and padded tokens, time per stage, the schedule's
    timers (executor/schedule.py) and, filled in by the engine at the end, the memory
    report and the block size it ran with."""

    sequences: int = 0
    prompt_tokens: int = 0
    padded_prompt_tokens: int = 0
    # through the layers at prefill: each block's shared prefix once (executor/shared_prefix.py),
    # then each GPU batch's columns after it, padding included; without sharing, the padded ones
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    padded_generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    blocks: int = 0
    timers: dict = field(default_factory=dict)
    block_size: int = 0  # the policy's sequences per block (the effective batch size)
    memory: dict = field(default_factory=dict)  # Engine.memory_report() after the run

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def add_timers(self, timers: dict) -> None:
        for k, v in timers.items():
            self.timers[k] = self.timers.get(k, 0.0) + v

    def as_dict(self) -> dict:
        """JSON-able, with total_s."""
        return {**dataclasses.asdict(self), "total_s": self.total_s}


@dataclass(frozen=True)
class GenerationRun:
    """Engine.generate's answer: one result per prompt, in the prompts' order, and the run's stats."""

    results: list[GenerationResult]
    stats: RunStats


@dataclass(frozen=True)
class ScoreRun:
    """Engine.score's answer: one result per prompt, in the prompts' order, and the run's stats."""

    results: list[ScoreResult]
    stats: RunStats


def select_tokens(logprobs: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                  ) -> torch.Tensor:
    """One next token per row of `logprobs` (float32, log-softmaxed), following each row's params."""
    greedy = logprobs.argmax(dim=-1)
    out = greedy.clone()
    for row, p in enumerate(params):
        if p.temperature == 0:
            continue
        scores = logprobs[row] / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = sorted_scores.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = probs.cumsum(-1) - probs >= p.top_p
            scores = scores.scatter(0, order[drop], -math.inf)
        probs = scores.softmax(-1)
        out[row] = torch.multinomial(probs, 1, generator=generators[row]).item()
    return out
