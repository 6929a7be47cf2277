"""Token ids -> the token strings HELM expects.

HELM's metrics count bytes and rebuild text from `Token.text`. A token that is not
valid UTF-8 on its own (half of a multi-byte character, as byte-level BPE produces)
is written the way HELM's OpenAI-style clients do: "bytes:" followed by every byte of
the token as a literal "\\xNN" escape; `helm.benchmark.metrics.basic_metrics`
(get_num_bytes, convert_tokens_to_text) counts and re-joins exactly that form.
Other tokens are their decoded text, so joining them gives the decoded sequence.

The bytes of each token come from the shared `flexgen_helm.text.TokenText`, so the
strings of a prompt (HELM tokenizer) and of a generation (HELM client) always agree.
`TokenText` and `token_text_for` lived here before flexgen_helm.text: the names below are
kept for old imports (deprecated; import them from flexgen_helm.text).
"""

from __future__ import annotations

from flexgen_helm.text.token_text import TokenText, token_text_for

__all__ = ["TokenText", "helm_text", "helm_texts", "token_text_for"]


def helm_text(tt: TokenText, token_id: int) -> str:
    b = tt.token_bytes(token_id)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def helm_texts(tt: TokenText, token_ids) -> list[str]:
    return [helm_text(tt, t) for t in token_ids]
