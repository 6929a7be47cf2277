"""SmolLM2-135M through transformers, outside the engine (transformers dequantizes the GGUF
itself): what the accuracy checks beside the sweep modify and score, kv_grouping.py here
and runs/accuracy/quant_check.py. WikiText-2 token perplexity over non-overlapping windows,
as the engine's evaluation counts it."""

from __future__ import annotations

import math

import torch

from flexgen_helm.data.sources import read_wikitext
from flexgen_helm.models.tokenizer import import_transformers
from flexgen_helm.weights.registry import resolve

WINDOW = 1024


def _gguf() -> tuple[str, str]:
    """(folder, file name) of the bundled GGUF, as transformers' gguf_file takes them."""
    path = resolve("smollm2-135m").source.path
    return str(path.parent), path.name


def smollm2_tokenizer():
    folder, name = _gguf()
    return import_transformers().AutoTokenizer.from_pretrained(folder, gguf_file=name)


def smollm2_model(**kwargs):
    """The model in float32, in eval mode; `kwargs` go to from_pretrained (attn_implementation)."""
    folder, name = _gguf()
    return import_transformers().AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                                      **kwargs).eval()


def wikitext_ids(tok, tokens: int) -> tuple[list[int], dict]:
    """The first `tokens` token ids of WikiText-2 test (paragraphs joined by blank lines) and
    the data's source record."""
    lines, source = read_wikitext()
    return tok("\n\n".join(lines))["input_ids"][:tokens], source


def token_perplexity(model, ids: list[int], window: int = WINDOW) -> float:
    """exp(mean NLL) of every token after the first of each window of `window` tokens."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), window):
            w = torch.tensor([ids[s:s + window]])
            lp = torch.log_softmax(model(w).logits[0, :-1].float(), -1)
            nll -= lp.gather(-1, w[0, 1:, None]).sum().item()
            n += w.shape[1] - 1
    return math.exp(nll / n)
