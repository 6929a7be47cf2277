"""WikiText perplexity, by one of two protocols (PROTOCOLS).

"windows", the usual LLM protocol and the default: the non-empty lines are joined with
"\n\n" (the official file separates paragraphs by blank lines), the whole text is
tokenized once and scored in non-overlapping windows of `window` tokens. The first token
of each window has no context, so it is not scored: token perplexity averages over scored
tokens only. Since the window-initial tokens add no NLL, word perplexity and bits per byte
are very slightly optimistic (by one token in `window`).

"documents", lm-evaluation-harness's rolling log-likelihood (its wikitext task), so that
the two tools can be compared on one protocol: each article (data/wikitext.split_articles)
is scored alone, after the model's document start token, and every one of its tokens is
scored once. The first piece predicts the article's first `window` tokens; each later piece
predicts the next `window` (the last one fewer), fed the `window` tokens before them, so
a piece is at most window + 1 tokens long.

Under both, word perplexity and bits per byte divide the total NLL by the whitespace words
/ UTF-8 bytes of the evaluated text (those do not depend on the tokenizer).
"""

from __future__ import annotations

import math

from tqdm.auto import tqdm

from flexgen_helm.data.wikitext import join_paragraphs, split_articles
from flexgen_helm.errors import FlexGenError
from flexgen_helm.evaluation.resume import ResumeLog

PROTOCOLS = ("windows", "documents")

# a piece of text to score: its token ids, and the index of its first scored token
Piece = tuple[list[int], int]


def tokenize(tokenizer, lines: list[str], limit: int | None) -> tuple[list[int], str]:
    """"windows": token ids of the joined text (the first `limit` of them), and the text they cover."""
    text = join_paragraphs(lines)
    # verbose=False: the whole text is longer than the model context on purpose
    enc = tokenizer(text, return_offsets_mapping=True, verbose=False)
    ids = enc["input_ids"]
    if limit is not None and limit < len(ids):
        ids = ids[:limit]
        text = text[:enc["offset_mapping"][limit - 1][1]]
    return ids, text


def tokenize_documents(tokenizer, lines: list[str], limit: int | None) -> tuple[list[list[int]], list[str]]:
    """"documents": token ids of each article (the first `limit` articles), and their texts;
    no special tokens (the start token is the scorer's to add)."""
    articles = split_articles(lines)[:limit]
    return [tokenizer(a, add_special_tokens=False, verbose=False)["input_ids"] for a in articles], articles


def window_pieces(ids: list[int], window: int) -> list[Piece]:
    """"windows": non-overlapping windows, each scored from its second token (a lone
    trailing token has nothing to score: no window starts at the last token)."""
    return [(ids[s:s + window], 1) for s in range(0, len(ids) - 1, window)]


def rolling_pieces(ids: list[int], start_token: int, window: int) -> list[Piece]:
    """"documents": the pieces that score every token of one document once (module doc)."""
    if not ids:
        return []
    pieces = [([start_token] + ids[:window], 1)]
    for done in range(window, len(ids), window):
        end = min(done + window, len(ids))
        pieces.append((ids[end - window - 1:end], window + 1 - (end - done)))
    return pieces


def evaluate(engine, ids: list[int], text: str, window: int, batch: int, progress: bool = True,
             as_decode: bool = False, resume: ResumeLog | None = None) -> dict:
    """"windows" protocol. Pieces recorded in `resume` are not scored again."""
    pieces = window_pieces(ids, window)
    if not pieces:
        raise FlexGenError("WikiText: fewer than two tokens to evaluate")
    total, scored = _score(engine, pieces, batch, progress, as_decode, resume)
    counts = {"tokens": len(ids), "tokens_scored": scored, "windows": len(pieces),
              "note": "the first token of each window has no context and is not scored; "
                      "words = whitespace-separated words of the evaluated text"}
    return _result(total, scored, [text], counts)


def evaluate_documents(engine, docs: list[list[int]], texts: list[str], window: int, start_token: int,
                       batch: int, progress: bool = True, as_decode: bool = False,
                       resume: ResumeLog | None = None) -> dict:
    """"documents" protocol, over the token ids `docs` of the articles `texts`."""
    pieces = [p for ids in docs for p in rolling_pieces(ids, start_token, window)]
    if not pieces:
        raise FlexGenError("WikiText: no tokens to evaluate")
    total, scored = _score(engine, pieces, batch, progress, as_decode, resume)
    counts = {"tokens": sum(len(d) for d in docs), "tokens_scored": scored, "windows": len(pieces),
              "documents": len(docs),
              "note": "every token scored, each document after the start token "
                      f"{start_token}; words = whitespace-separated words of the documents"}
    return _result(total, scored, texts, counts)


def _score(engine, pieces: list[Piece], batch: int, progress: bool, as_decode: bool,
           resume: ResumeLog | None) -> tuple[float, int]:
    """Total NLL of the pieces' scored tokens, and their count."""
    resume = resume or ResumeLog(None, {})
    nll, scored = [], 0
    for s in tqdm(range(0, len(pieces), batch), desc="wikitext", unit="chunk", disable=not progress):
        chunk = pieces[s:s + batch]
        keys = [f"window:{w}" for w in range(s, s + len(chunk))]
        results = resume.get(keys)
        if results is None:
            run = engine.score([ids for ids, _ in chunk], as_decode=as_decode, first_scored=[f for _, f in chunk])
            results = [[-math.fsum(r.logprobs[f:]), len(r.logprobs) - f] for r, (_, f) in zip(run.results, chunk)]
            resume.add(dict(zip(keys, results)))
        for loss, n in results:
            nll.append(loss)
            scored += n
    return math.fsum(nll), scored


def _result(total: float, scored: int, texts: list[str], counts: dict) -> dict:
    words = sum(len(t.split()) for t in texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {
        "metrics": {"token_perplexity": math.exp(total / scored), "word_perplexity": math.exp(total / words),
                    "bits_per_byte": total / math.log(2) / n_bytes},
        "counts": {**counts, "words": words, "bytes": n_bytes, "total_nll": total},
    }
