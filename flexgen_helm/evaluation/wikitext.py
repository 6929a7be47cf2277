"""WikiText perplexity: the usual LLM protocol.

The non-empty lines are joined with "\n\n" (the official file separates paragraphs by
blank lines), the whole text is tokenized once and scored in non-overlapping windows of
`window` tokens. The first token of each window has no context, so it is not scored:
token perplexity averages over scored tokens only. Word perplexity and bits per byte
divide the same total NLL by the whitespace words / UTF-8 bytes of the evaluated text
(those do not depend on the tokenizer); since the window-initial tokens add no NLL they
are very slightly optimistic (by one token in `window`).
"""

from __future__ import annotations

import math

from tqdm.auto import tqdm

from flexgen_helm.data.wikitext import join_paragraphs
from flexgen_helm.errors import FlexGenError
from flexgen_helm.evaluation.resume import ResumeLog


def tokenize(tokenizer, lines: list[str], limit: int | None) -> tuple[list[int], str]:
    """Token ids of the joined text (the first `limit` of them), and the text they cover."""
    text = join_paragraphs(lines)
    # verbose=False: the whole text is longer than the model context on purpose
    enc = tokenizer(text, return_offsets_mapping=True, verbose=False)
    ids = enc["input_ids"]
    if limit is not None and limit < len(ids):
        ids = ids[:limit]
        text = text[:enc["offset_mapping"][limit - 1][1]]
    return ids, text


def evaluate(engine, ids: list[int], text: str, window: int, batch: int, progress: bool = True,
             as_decode: bool = False, resume: ResumeLog | None = None) -> dict:
    """Windows recorded in `resume` are not scored again."""
    resume = resume or ResumeLog(None, {})
    windows = [ids[s:s + window] for s in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) > 1]  # a lone trailing token has nothing to score
    if not windows:
        raise FlexGenError("WikiText: fewer than two tokens to evaluate")
    nll, scored = [], 0
    for s in tqdm(range(0, len(windows), batch), desc="wikitext", unit="chunk", disable=not progress):
        keys = [f"window:{w}" for w in range(s, min(s + batch, len(windows)))]
        results = resume.get(keys)
        if results is None:
            # logprobs[0] is nan: the window's first token has no context
            results = [[-math.fsum(r.logprobs[1:]), len(r.logprobs) - 1]
                       for r in engine.score(windows[s:s + batch], as_decode=as_decode).results]
            resume.add(dict(zip(keys, results)))
        for loss, n in results:
            nll.append(loss)
            scored += n
    total = math.fsum(nll)
    words, n_bytes = len(text.split()), len(text.encode("utf-8"))
    return {
        "metrics": {"token_perplexity": math.exp(total / scored), "word_perplexity": math.exp(total / words),
                    "bits_per_byte": total / math.log(2) / n_bytes},
        "counts": {"tokens": len(ids), "tokens_scored": scored, "windows": len(windows),
                   "words": words, "bytes": n_bytes, "total_nll": total,
                   "note": "the first token of each window has no context and is not scored; "
                           "words = whitespace-separated words of the evaluated text"},
    }
