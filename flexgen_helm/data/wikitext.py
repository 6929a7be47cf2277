"""WikiText-2 text: its paragraphs joined back as the file has them, and its articles."""

from __future__ import annotations

import re

# The official file separates paragraphs by a blank line; read_wikitext drops the blank lines.
PARAGRAPH_BREAK = "\n\n"
_ARTICLE_HEADING = re.compile(r"^ ?= [^=].* = ?$")  # " = Title = " but not " = = Section = = "


def join_paragraphs(lines: list[str]) -> str:
    """The text of the non-empty lines that read_wikitext returns, as the usual perplexity
    protocol scores it."""
    return PARAGRAPH_BREAK.join(lines)


def split_articles(lines: list[str]) -> list[str]:
    """One text per article: an article starts at a top-level heading (" = Title = ") and
    runs to the next one; lines before the first heading form an article of their own."""
    articles, current = [], []
    for line in lines:
        if _ARTICLE_HEADING.match(line) and current:
            articles.append(join_paragraphs(current))
            current = []
        current.append(line)
    if current:
        articles.append(join_paragraphs(current))
    return articles
