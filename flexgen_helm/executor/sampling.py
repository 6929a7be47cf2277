"""Per-request generation parameters and outputs (plain data), and token selection."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # the model's EOS is added unless ignore_eos
    stop_strings: tuple[str, ...] = ()
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
        if self.num_completions < 1:
            raise FlexGenError(f"num_completions must be >= 1, got {self.num_completions}")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the model (before temperature / top-p)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "length"  # "length", "stop" (EOS or stop token) or "stop_string"


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
