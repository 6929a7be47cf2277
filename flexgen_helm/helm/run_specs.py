"""Run spec functions of the plugin: `lambada` and `wikitext`.

    helm-run -r "lambada:model=flexgen/smollm2-135m" -m 100 --suite s
    helm-run -r "wikitext:model=flexgen/smollm2-135m" -m 5 --suite s
    (args: path=FILE to read a specific file; wikitext also unit=article|paragraph)
"""

from __future__ import annotations

from typing import Optional

from helm.benchmark.adaptation.adapter_spec import ADAPT_GENERATION, AdapterSpec
from helm.benchmark.adaptation.common_adapter_specs import get_language_modeling_adapter_spec
from helm.benchmark.metrics.common_metric_specs import get_exact_match_metric_specs, get_language_modeling_metric_specs
from helm.benchmark.run_spec import RunSpec, run_spec_function
from helm.benchmark.scenarios.scenario import ScenarioSpec


def _args(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


@run_spec_function("lambada")
def get_lambada_spec(path: Optional[str] = None, max_tokens: int = 8) -> RunSpec:
    # Zero-shot, no instructions or prefixes: the passage is the prompt, and greedy
    # decoding must continue it with " <last word>" (prefix_exact_match = accuracy).
    adapter_spec = AdapterSpec(
        method=ADAPT_GENERATION,
        instructions="",
        input_prefix="",
        input_suffix="",
        output_prefix="",
        output_suffix="",
        max_train_instances=0,
        num_outputs=1,
        max_tokens=int(max_tokens),
        temperature=0.0,
        stop_sequences=["\n"],
    )
    return RunSpec(
        name="lambada" + (f":path={path}" if path else ""),
        scenario_spec=ScenarioSpec(
            class_name="flexgen_helm.helm.scenarios.lambada.LambadaScenario", args=_args(path=path)
        ),
        adapter_spec=adapter_spec,
        metric_specs=get_exact_match_metric_specs(),
        groups=["lambada"],
    )


@run_spec_function("wikitext")
def get_wikitext_spec(unit: str = "article", path: Optional[str] = None) -> RunSpec:
    name = f"wikitext:unit={unit}" + (f",path={path}" if path else "")
    return RunSpec(
        name=name,
        scenario_spec=ScenarioSpec(
            class_name="flexgen_helm.helm.scenarios.wikitext.WikiTextScenario", args=_args(unit=unit, path=path)
        ),
        adapter_spec=get_language_modeling_adapter_spec(),
        metric_specs=get_language_modeling_metric_specs([]),
        groups=["wikitext"],
    )
