"""LAMBADA (OpenAI variant, test split): predict the last word of a passage.

Instance input: the passage without its last word; the one correct reference: the
last word. With greedy decoding, HELM's `prefix_exact_match` (generation starts with
the word) is the usual LAMBADA accuracy (the greedy continuation begins with all of
the word's tokens).
"""

from __future__ import annotations

import json
from typing import List, Optional

from helm.benchmark.scenarios.scenario import CORRECT_TAG, TEST_SPLIT, Input, Instance, Output, Reference, Scenario

from flexgen_helm.data.sources import local_file, missing, offline

RELATIVE = "lambada/lambada_openai_test.jsonl"


def split_last_word(text: str) -> tuple[str, str]:
    """(context, last word); the context keeps no trailing space (the model must produce it)."""
    text = text.rstrip()
    cut = max(text.rfind(" "), text.rfind("\n"))
    return text[:cut], text[cut + 1:]


class LambadaScenario(Scenario):
    name = "lambada"
    description = "LAMBADA (OpenAI test split): last-word prediction"
    tags = ["language_modeling", "lambada"]

    def __init__(self, path: Optional[str] = None):
        super().__init__()
        self.path = path

    def _texts(self) -> List[str]:
        local = local_file(RELATIVE, self.path)
        if local:
            with open(local, encoding="utf-8") as f:
                return [json.loads(line)["text"] for line in f if line.strip()]
        if offline():
            raise missing("LAMBADA", RELATIVE)
        try:
            import datasets

            return list(datasets.load_dataset("EleutherAI/lambada_openai", "default", split="test")["text"])
        except Exception as exc:  # any hub failure means: no data here
            raise missing("LAMBADA", RELATIVE) from exc

    def get_instances(self, output_path: str) -> List[Instance]:
        instances = []
        for i, text in enumerate(self._texts()):
            context, word = split_last_word(text)
            instances.append(Instance(
                input=Input(text=context),
                references=[Reference(Output(text=word), tags=[CORRECT_TAG])],
                split=TEST_SPLIT, id=f"id{i}",
            ))
        return instances
