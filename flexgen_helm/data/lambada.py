"""LAMBADA passages: the part the model reads and the last word it must produce."""

from __future__ import annotations

from flexgen_helm.errors import FlexGenError


def split_last_word(text: str) -> tuple[str, str]:
    """(context, word): the passage, without its surrounding whitespace, cut at its last
    run of whitespace. Neither part keeps the whitespace at the cut: the HELM scenario
    uses `word` as its reference as is (HELM's exact-match metrics strip both sides), and
    `flexgen-helm eval` scores " " + word, the tokens that follow the context in the text
    (in LAMBADA the cut is always one space)."""
    parts = text.strip().rsplit(None, 1)
    if len(parts) != 2:
        raise FlexGenError(f"LAMBADA passage has no context before its last word: {text[:80]!r}")
    return parts[0], parts[1]
