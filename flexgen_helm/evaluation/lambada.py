"""LAMBADA: predict the last word of a passage (OpenAI variant, test split).

The model sees the passage without its last word and must produce the word exactly,
greedily, all of its tokens. Both metrics come from one scoring pass over
context + target per passage:

- accuracy: at every target position the model's argmax (top-1) is the target token.
  This is exactly "greedy decoding from the context reproduces the target tokens": by
  induction, if the argmax after the context is target[0], greedy decoding appends it and
  the next argmax is computed on context + target[0], which is what the scoring pass saw,
  and so on; if one argmax differs, greedy decoding diverges there. One teacher-forced
  pass costs a single prefill instead of a prefill plus len(target) decode steps.
  (Caveat: scoring runs the prefill path only; KV-cache compression and sparse attention
  act in decode. `generation_accuracy` measures the decode path when that matters.)
- last-word perplexity: exp of the mean, over passages, of the negative log-likelihood of
  the whole last word (the sum over its tokens): a per-word, not per-token, perplexity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tqdm.auto import tqdm

from flexgen_helm.data.lambada import split_last_word
from flexgen_helm.errors import FlexGenError
from flexgen_helm.evaluation.resume import ResumeLog


@dataclass(frozen=True)
class Item:
    context: list[int]  # the passage without its last word
    target: list[int]  # the tokens of " " + last word, as they follow the context

    @property
    def full(self) -> list[int]:
        return self.context + self.target


def context_and_target(text: str) -> tuple[str, str]:
    """(context, target): the target is the text that follows the context, " " + last word."""
    context, word = split_last_word(text)
    return context, " " + word


def prepare(tokenizer, texts: list[str]) -> tuple[list[Item], int]:
    """Items, and how many passages tokenize differently at the context/target boundary.

    The target tokens are those of tokenize(context + target) after tokenize(context).
    When the tokenizer merges across the boundary (rare: the target starts with a space),
    the context is the longest common prefix and the target takes the rest."""
    contexts, targets = zip(*(context_and_target(t) for t in texts))
    ctx_ids = tokenizer(list(contexts))["input_ids"]
    full_ids = tokenizer([c + t for c, t in zip(contexts, targets)])["input_ids"]
    items, merged = [], 0
    for ctx, full in zip(ctx_ids, full_ids):
        p = 0
        while p < min(len(ctx), len(full)) and ctx[p] == full[p]:
            p += 1
        merged += p < len(ctx)
        if p == 0 or p == len(full):
            raise FlexGenError("a LAMBADA passage tokenized to an empty context or an empty target")
        items.append(Item(full[:p], full[p:]))
    return items, merged


def _chunks(order: list[int], size: int, progress: bool, desc: str):
    """Passages in order of length, `size` at a time: one engine call per chunk (the
    engine buckets each call into blocks; sorting first keeps the padding small)."""
    starts = range(0, len(order), size)
    for s in tqdm(starts, desc=desc, unit="chunk", disable=not progress):
        yield order[s:s + size]


def evaluate(engine, items: list[Item], chunk: int, progress: bool = True, as_decode: bool = False,
             resume: ResumeLog | None = None) -> dict:
    """Per-passage correctness and last-word NLL, and the aggregate metrics (as_decode:
    Engine.score's). Chunks recorded in `resume` are not scored again."""
    resume = resume or ResumeLog(None, {})
    order = sorted(range(len(items)), key=lambda i: len(items[i].full))
    correct, nll = [False] * len(items), [0.0] * len(items)
    for idx in _chunks(order, chunk, progress, "lambada"):
        keys = [f"score:{i}" for i in idx]
        results = resume.get(keys)
        if results is None:
            results = []
            scored = engine.score([items[i].full for i in idx], top_logprobs=1, as_decode=as_decode,
                                  first_scored=[len(items[i].context) for i in idx]).results  # the last word only
            for i, r in zip(idx, scored):
                k = len(items[i].context)
                # top_logprobs[j] holds the argmax predicting token j (ties: one of them)
                argmax = [next(iter(top)) for top in r.top_logprobs[k:]]
                results.append([argmax == items[i].target, -math.fsum(r.logprobs[k:])])
            resume.add(dict(zip(keys, results)))
        for i, (ok, loss) in zip(idx, results):
            correct[i], nll[i] = ok, loss
    n = len(items)
    return {
        "correct": correct,
        "nll": nll,
        "metrics": {"accuracy": sum(correct) / n, "last_word_perplexity": math.exp(math.fsum(nll) / n)},
        "counts": {"passages": n, "correct": sum(correct),
                   "target_tokens": sum(len(it.target) for it in items),
                   "multi_token_targets": sum(len(it.target) > 1 for it in items),
                   "tokens_scored": sum(len(it.full) for it in items)},
    }


def generation_accuracy(engine, items: list[Item], chunk: int, progress: bool = True,
                        resume: ResumeLog | None = None) -> tuple[float, list[bool]]:
    """Accuracy by greedy generation of len(target) tokens: the decode path, where a
    compressed KV cache and sparse attention act (the first target token still comes
    from the prefill)."""
    from flexgen_helm.executor.sampling import SamplingParams

    resume = resume or ResumeLog(None, {})
    order = sorted(range(len(items)), key=lambda i: len(items[i].context))
    correct = [False] * len(items)
    for idx in _chunks(order, chunk, progress, "lambada generate"):
        keys = [f"generate:{i}" for i in idx]
        results = resume.get(keys)
        if results is None:
            params = [SamplingParams(max_new_tokens=len(items[i].target), ignore_eos=True) for i in idx]
            outputs = engine.generate([items[i].context for i in idx], params).results
            results = [[r.completions[0].token_ids == items[i].target] for i, r in zip(idx, outputs)]
            resume.add(dict(zip(keys, results)))
        for i, (ok,) in zip(idx, results):
            correct[i] = ok
    return sum(correct) / len(items), correct
