"""Text prompts in, text completions out, over any EngineCore (the Python API for text)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from flexgen_helm.engine import Engine, EngineCore, check_fits_context
from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.sampling import Completion, RunStats, SamplingParams, ScoreRun
from flexgen_helm.text.stopping import StopStrings
from flexgen_helm.text.token_text import token_text_for
from flexgen_helm.weights.registry import resolve


@dataclass
class TextCompletion:
    text: str  # cut before the first stop string
    token_ids: list[int]  # every generated token, those after a stop string too
    logprobs: list[float]  # log p(token) under the model (before temperature / top-p)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "length"  # "length", "stop" (EOS or stop token id) or "stop_string"


@dataclass
class TextResult:
    prompt: str
    prompt_token_ids: list[int]
    completions: list[TextCompletion]


@dataclass(frozen=True)
class TextRun:
    results: list[TextResult]
    stats: RunStats


def check_text_request(model: str, prompts: list[str], params: SamplingParams, path: str | None = None,
                       dummy: bool = False, stop_strings: Sequence[str] = ()) -> None:
    """The refusals of generating `prompts` with `params` that need no weight of `model`,
    made before any is read (loading a large model takes minutes): the sampling settings, the
    stop strings (an empty one would stop nothing: StopStrings skips it, as a HELM request's
    may carry one), and each prompt's encoding (the model's tokenizer, as TextEngine encodes
    it): not empty, and within the context."""
    params.validate()
    for i, stop in enumerate(stop_strings):
        if not stop:
            raise FlexGenError(f"stop string {i} is empty: it would stop nothing (leave it out to generate "
                               f"up to the new-token limit)")
    resolved = resolve(model, path=path, dummy=dummy)
    token_text = token_text_for(resolved.load_tokenizer())
    for i, prompt in enumerate(prompts):
        tokens = len(token_text.encode_prompt(prompt))
        if not tokens:
            raise FlexGenError(f"prompt {i} is empty (no tokens)")
        check_fits_context(resolved.config, f"prompt {i}", tokens, params.max_new_tokens)


class TextEngine:
    """An engine for text: prompts are encoded with the model's tokenizer (its default
    encoding, with the BOS the model was trained with), completions decoded and cut at
    stop strings (flexgen_helm.text.StopStrings)."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.token_text = token_text_for(engine.tokenizer)

    @classmethod
    def load(cls, model: str, *args, **kwargs) -> "TextEngine":
        """Engine.load(model, ...) wrapped for text."""
        return cls(Engine.load(model, *args, **kwargs))

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.token_text.encode_prompt(p) for p in prompts]

    def generate(self, prompts: list[str], params: SamplingParams | list[SamplingParams] | None = None,
                 stop_strings: tuple[str, ...] | list[str] = ()) -> TextRun:
        """Completions of text prompts; generation ends at the first of `stop_strings`."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        stop = StopStrings(self.token_text, tuple(stop_strings))
        if stop.strings:
            per_prompt = [dataclasses.replace(p, stop=stop) for p in per_prompt]
        run = self.engine.generate(self.encode(prompts), per_prompt)
        results = [TextResult(prompt, r.prompt_token_ids, [self._text_completion(c, stop) for c in r.completions])
                   for prompt, r in zip(prompts, run.results)]
        return TextRun(results=results, stats=run.stats)

    def score(self, prompts: list[str], top_logprobs: int = 0, as_decode: bool = False) -> ScoreRun:
        """Engine.score of the prompts' default encodings."""
        return self.engine.score(self.encode(prompts), top_logprobs=top_logprobs, as_decode=as_decode)

    @staticmethod
    def _text_completion(c: Completion, stop: StopStrings) -> TextCompletion:
        cut = stop.cut(c.token_ids)
        return TextCompletion(text=cut.text, token_ids=c.token_ids, logprobs=c.logprobs, top_logprobs=c.top_logprobs,
                              finish_reason="stop_string" if cut.stopped else c.finish_reason)
