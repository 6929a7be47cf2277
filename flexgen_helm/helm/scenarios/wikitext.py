"""WikiText-2 (raw) test split, for perplexity under HELM's language-modeling adapter.

The usual protocol joins the file's lines with "\n\n" (the official file separates
paragraphs by blank lines); one instance per article (top-level " = Title = "
heading), which HELM scores in windows of the model's context. `unit=paragraph`
makes one instance per line instead (short instances for quick runs).
"""

from __future__ import annotations

import re
from typing import List, Optional

from helm.benchmark.scenarios.scenario import TEST_SPLIT, Input, Instance, Scenario

from flexgen_helm.data.sources import local_file, missing, offline

RELATIVE = "wikitext-2-raw/wiki.test.raw"
_ARTICLE = re.compile(r"^ ?= [^=].* = ?$")  # " = Title = " but not " = = Section = = "


class WikiTextScenario(Scenario):
    name = "wikitext"
    description = "WikiText-2 raw test split: language-model perplexity"
    tags = ["language_modeling", "wikitext"]

    def __init__(self, unit: str = "article", path: Optional[str] = None):
        super().__init__()
        if unit not in ("article", "paragraph"):
            raise ValueError(f"unit must be 'article' or 'paragraph', got {unit!r}")
        self.unit = unit
        self.path = path

    def _lines(self) -> List[str]:
        local = local_file(RELATIVE, self.path)
        if local:
            with open(local, encoding="utf-8", newline="") as f:
                text = f.read()
            lines = text.replace("\r\n", "\n").split("\n")
        elif offline():
            raise missing("WikiText-2", RELATIVE)
        else:
            try:
                import datasets

                lines = datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split="test")["text"]
            except Exception as exc:
                raise missing("WikiText-2", RELATIVE) from exc
        return [line.rstrip("\n") for line in lines if line.strip()]

    def get_instances(self, output_path: str) -> List[Instance]:
        lines = self._lines()
        if self.unit == "paragraph":
            docs = list(lines)
        else:
            docs, cur = [], []
            for line in lines:
                if _ARTICLE.match(line) and cur:
                    docs.append("\n\n".join(cur))
                    cur = []
                cur.append(line)
            if cur:
                docs.append("\n\n".join(cur))
        return [Instance(input=Input(text=d), references=[], split=TEST_SPLIT, id=f"id{i}")
                for i, d in enumerate(docs)]
