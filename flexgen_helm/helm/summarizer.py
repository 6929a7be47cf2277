"""helm-summarize for flexgen suites: HELM's Summarizer, with our models, throughput and
one leaderboard table.

    flexgen-helm leaderboard --suite demo     # runs schema.summarize_command, i.e.
    helm-summarize --suite demo --schema-path "$(python -m flexgen_helm.helm.schema)" \
        --summarizer-class-name flexgen_helm.helm.summarizer.FlexGenSummarizer
    helm-server --suite demo                  # Leaderboard: one row per deployment

HELM's summarizer is told what to show by a schema (schema_flexgen.yaml, beside this
module); four things a schema cannot say are done here:
  * register the flexgen model metadata: helm-summarize, unlike helm-run, loads no
    plugins, so our deployments would have no display names (uncompressed / 8-bit / 4-bit)
    and no entry on the Models page;
  * give each run the throughput the engine measured (the flexgen_* metrics of the schema):
    HELM's metrics know per-request runtimes only, while our batches record real and
    padded tokens (flexgen_helm.helm.accounting, in scenario_state.json);
  * draw each group of category ONE_TABLE_CATEGORY (the LEADERBOARD_GROUP, the paper's
    sub-scenarios) as one table of all its metric groups (accuracy, language modeling,
    throughput), where HELM would draw one table per metric group, of which the web page
    shows the first only;
  * give that table a Precision column (FP16 / BF16 / 8-bit / 4-bit): what the engine ran
    each deployment's runs with, as every response recorded it (accounting.py), so the
    column says what was measured whatever a deployment's name promises.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import replace

from helm.benchmark.metrics.metric_name import MetricName
from helm.benchmark.metrics.statistic import Stat
from helm.benchmark.presentation.schema import RunGroup
from helm.benchmark.presentation.summarize import (
    Run,
    Summarizer,
    get_coarse_adapter_spec,
    get_model_metadata_for_adapter_spec,
)
from helm.benchmark.presentation.table import Cell, HeaderCell, Table

import flexgen_helm.helm.plugin  # noqa: F401  (registers the flexgen model metadata)
from flexgen_helm.helm import accounting
from flexgen_helm.helm.schema import ONE_TABLE_CATEGORY

PRECISION_HEADER = "Precision"
PRECISION_DESCRIPTION = ("What the engine computed each deployment's runs with, as every response recorded it: "
                         "FP16 / BF16 / FP32 = uncompressed weights and KV cache in that type (the device's own: "
                         "FP16 on a GPU, BF16 or FP32 on a CPU); 8-bit / 4-bit = weights and KV cache quantized "
                         "group-wise (min/max unless named: a fitted quantizer, e.g. 4-bit hqq; 8-bit per-channel = "
                         "one group per output channel, the shipped 8-bit deployment; 4-bit gguf = the GGUF file's "
                         "own codes, the shipped 4-bit deployment).")

# flexgen_* metric -> accounting.summarize's key
THROUGHPUT_METRICS = {
    "flexgen_actual_throughput": "actual_throughput_tok_s",
    "flexgen_padded_throughput": "padded_throughput_tok_s",
    "flexgen_padding_efficiency": "efficiency",
    "flexgen_engine_time": "engine_time_s",
}


def throughput_stats(run_path: str, splits: set[str]) -> list[Stat]:
    """The run's throughput from its batch records, one Stat per metric and split; none for
    a run without records (not computed by a flexgen deployment, or every request failed).

    Batches mix splits (HELM's valid and test instances run together), so the numbers are of
    the whole run, listed under each split that HELM's own stats use."""
    state_path = os.path.join(run_path, "scenario_state.json")
    if not os.path.isfile(state_path):
        return []
    summary = accounting.summarize_run(run_path)
    if not summary["requests"]:
        return []
    return [Stat(MetricName(metric, split=split)).add(summary[key])
            for metric, key in THROUGHPUT_METRICS.items() if summary[key] is not None for split in sorted(splits)]


def run_precision(run_path: str) -> str:
    """What the engine computed the run with ("BF16", "8-bit", "4-bit", ...), as its
    responses recorded it (accounting.precision_from_scenario_state)."""
    state_path = os.path.join(run_path, "scenario_state.json")
    if not os.path.isfile(state_path):
        return accounting.PRECISION_NOT_RECORDED
    with open(state_path) as f:
        return accounting.precision_from_scenario_state(json.load(f))


def with_precision_column(table: Table, precision_of_row: dict[str, str]) -> Table:
    """`table` with a Precision column after the model's: the setting each row's runs recorded."""
    header = [table.header[0], HeaderCell(PRECISION_HEADER, description=PRECISION_DESCRIPTION), *table.header[1:]]
    rows = [[row[0], Cell(precision_of_row.get(row[0].value, accounting.PRECISION_NOT_RECORDED)), *row[1:]]
            for row in table.rows]
    return replace(table, header=header, rows=rows)


class FlexGenSummarizer(Summarizer):
    def read_run(self, run_path: str) -> Run:
        run = super().read_run(run_path)
        splits = {s.name.split for s in run.stats if s.name.split}
        run.stats.extend(throughput_stats(run_path, splits))
        return run

    def create_group_tables_by_metric_group(self, group: RunGroup) -> list[Table]:
        if group.category != ONE_TABLE_CATEGORY:
            return super().create_group_tables_by_metric_group(group)
        # the scenario groups under it (expand_subgroups lists the group itself first)
        subgroups = [g for g in self.expand_subgroups(group) if not g.subgroups]
        adapter_to_runs = defaultdict(list)
        for subgroup in subgroups:
            for adapter_spec, runs in self.group_adapter_to_runs[subgroup.name].items():
                # one row per deployment, coarsened as HELM's own tables do
                coarse = get_coarse_adapter_spec(adapter_spec, adapter_keys_shown=group.adapter_keys_shown)
                adapter_to_runs[coarse].extend(self.filter_runs_by_visibility(runs, group))
        adapter_to_runs = {spec: runs for spec, runs in adapter_to_runs.items() if runs}
        if not adapter_to_runs:
            return []
        # columns by metric group, then scenario: all the accuracies, then the language
        # modeling, then the throughputs; create_group_table skips the pairs whose scenario
        # does not list the metric group (wikitext has no accuracy)
        columns = [(subgroup, metric_group) for metric_group in group.metric_groups for subgroup in subgroups]
        table = self.create_group_table(name=group.name, title=group.display_name or group.name,
                                        adapter_to_runs=adapter_to_runs, columns=columns, is_scenario_table=False)
        if len(table.header) <= 1:
            return []
        # rows are named by their model's display name (adapter_keys_shown leaves nothing else to name)
        precision_of_row = {get_model_metadata_for_adapter_spec(spec).display_name:
                            " + ".join(sorted({run_precision(run.run_path) for run in runs}))
                            for spec, runs in adapter_to_runs.items()}
        return [with_precision_column(table, precision_of_row)]

