"""LAMBADA (OpenAI variant, test split): predict the last word of a passage.

Instance input: the passage without its last word; the one correct reference: the
last word. With greedy decoding, HELM's `prefix_exact_match` (generation starts with
the word) is the usual LAMBADA accuracy (the greedy continuation begins with all of
the word's tokens).
"""

from __future__ import annotations

from typing import List, Optional

from helm.benchmark.scenarios.scenario import CORRECT_TAG, TEST_SPLIT, Input, Instance, Output, Reference, Scenario

from flexgen_helm.data.lambada import split_last_word
from flexgen_helm.data.sources import read_lambada
from flexgen_helm.helm.scenarios import RUN_ENTRY_HINT


class LambadaScenario(Scenario):
    name = "lambada"
    description = "LAMBADA (OpenAI test split): last-word prediction"
    tags = ["language_modeling", "lambada"]

    def __init__(self, path: Optional[str] = None):
        super().__init__()
        self.path = path

    def get_instances(self, output_path: str) -> List[Instance]:
        texts, _ = read_lambada(self.path, hint=RUN_ENTRY_HINT)
        instances = []
        for i, text in enumerate(texts):
            context, word = split_last_word(text)
            instances.append(Instance(
                input=Input(text=context),
                references=[Reference(Output(text=word), tags=[CORRECT_TAG])],
                split=TEST_SPLIT, id=f"id{i}",
            ))
        return instances
