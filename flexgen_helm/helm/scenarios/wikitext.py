"""WikiText-2 (raw) test split, for perplexity under HELM's language-modeling adapter.

The usual protocol joins the file's lines with "\n\n" (the official file separates
paragraphs by blank lines); one instance per article (top-level " = Title = "
heading), which HELM scores in windows of the model's context. `unit=paragraph`
makes one instance per line instead (short instances for quick runs).
"""

from __future__ import annotations

from typing import List, Optional

from helm.benchmark.scenarios.scenario import TEST_SPLIT, Input, Instance, Scenario

from flexgen_helm.data.sources import read_wikitext
from flexgen_helm.data.wikitext import split_articles
from flexgen_helm.helm.scenarios import RUN_ENTRY_HINT


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

    def get_instances(self, output_path: str) -> List[Instance]:
        lines, _ = read_wikitext(self.path, hint=RUN_ENTRY_HINT)
        docs = lines if self.unit == "paragraph" else split_articles(lines)
        return [Instance(input=Input(text=d), references=[], split=TEST_SPLIT, id=f"id{i}")
                for i, d in enumerate(docs)]
