"""HELM's summarizer and web UI on a flexgen suite: helm-summarize with the plugin's schema
and summarizer makes one leaderboard table (LAMBADA accuracy, WikiText perplexity and
bits/byte, throughput; one row per deployment, named with its compression, its Precision
column what the runs recorded), and the screenshot tool photographs helm-server's page of
it (where Chromium is installed).

The suite: the fake engine, three deployments (uncompressed, 8-bit, 4-bit) x three
scenarios, three instances each (the session's, conftest.fake_helm_suite).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

import flexgen_helm

pytest.importorskip("helm")

from conftest import FAKE_SUITE_DEPLOYMENTS
from test_helm_e2e import stats

from flexgen_helm.errors import BrowserError, FlexGenError
from flexgen_helm.helm import accounting
from flexgen_helm.helm.schema import SCHEMA_PATH, summarize_command
from flexgen_helm.tools.report import leaderboard, screenshot

HELM_DIR = Path(SCHEMA_PATH).parent
DEPLOYMENTS = FAKE_SUITE_DEPLOYMENTS
# what each deployment's runs record (the fake engine computes in float32, under the deployment's policy)
PRECISIONS = ("FP32", "8-bit per-channel", "4-bit gguf")
COLUMNS = ["Model", "Precision", "LAMBADA - Accuracy (PEM)", "Pattern match - EM", "WikiText - Perplexity",
           "WikiText - Bits/byte", "LAMBADA - tok/s", "WikiText - tok/s", "Pattern match - tok/s"]


def _yaml(name: str) -> dict:
    return yaml.safe_load((HELM_DIR / name).read_text())


def display_names() -> dict[str, str]:
    return {m["name"]: m["display_name"] for m in _yaml("model_metadata.yaml")["models"]}


@pytest.fixture(scope="module")
def suite(fake_helm_suite):
    """(output path, suite folder) of a summarized suite."""
    out = fake_helm_suite / "out"
    # helm-summarize imports our summarizer class: the flexgen_helm under test, not an installed one
    root = str(Path(flexgen_helm.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(summarize_command("t", str(out)), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # every group, metric and model the suite uses is in the schema: HELM warns of none
    assert "undefined" not in proc.stdout + proc.stderr
    return out, out / "runs" / "t"


def test_leaderboard_table_has_our_columns_and_one_row_per_deployment(suite):
    _, suite_dir = suite
    tables = json.loads(leaderboard.groups_json(suite_dir).read_text())
    assert len(tables) == 1
    table = tables[0]
    assert [h["value"] for h in table["header"]] == COLUMNS
    names = display_names()
    assert [row[0]["value"] for row in table["rows"]] == [names[d] for d in DEPLOYMENTS]
    assert [row[1]["value"] for row in table["rows"]] == list(PRECISIONS)

    runs = {}  # (scenario, deployment) -> run folder
    for p in suite_dir.iterdir():
        if (p / "run_spec.json").is_file():
            spec = json.loads((p / "run_spec.json").read_text())
            runs[spec["name"].split(":")[0], spec["adapter_spec"]["model_deployment"]] = p
    for deployment, row in zip(DEPLOYMENTS, table["rows"]):
        cells = dict(zip(COLUMNS, (c.get("value") for c in row)))
        wiki = runs["wikitext", deployment]
        wiki_stats = stats(wiki)
        assert cells["WikiText - Perplexity"] == pytest.approx(wiki_stats["perplexity"])
        assert cells["WikiText - Bits/byte"] == pytest.approx(wiki_stats["bits_per_byte"])
        assert 0.0 <= cells["LAMBADA - Accuracy (PEM)"] <= 1.0
        lam = runs["lambada", deployment]
        # the throughput is the engine's, from the run's batch records
        assert cells["LAMBADA - tok/s"] == pytest.approx(accounting.summarize_run(str(lam))["actual_throughput_tok_s"])
        assert cells["WikiText - tok/s"] > 0 and cells["Pattern match - tok/s"] > 0


def test_web_ui_opens_on_the_leaderboard_and_knows_our_models(suite):
    _, suite_dir = suite
    index = json.loads((suite_dir / "groups.json").read_text())
    # helm-server's Leaderboard page shows the first group of the first index table
    assert index[0]["rows"][0][0]["href"].endswith("group=flexgen")
    models = {m["name"]: m["display_name"] for m in json.loads((suite_dir / "schema.json").read_text())["models"]}
    assert models == {d: display_names()[d] for d in DEPLOYMENTS}


PAPER_CONF = Path(__file__).resolve().parents[1] / "scenarios" / "paper_table22.conf"
# the paper's table: each sub-scenario's main metric, then each one's throughput
PAPER_COLUMNS = ["Model", "Precision", "MMLU - EM", "Pattern match - EM", "Synthetic reasoning (natural) - F1",
                 "WikiFact - EM (quasi)", "XSUM - ROUGE-2", "MMLU - tok/s", "Pattern match - tok/s",
                 "Synthetic reasoning (natural) - tok/s", "WikiFact - tok/s", "XSUM - tok/s"]


def test_the_papers_sub_scenarios_have_groups_with_their_main_metrics(suite):
    """Every group a run of scenarios/paper_table22.conf lands in is in the schema, and the
    paper's group draws them side by side (here with the pattern-match runs of the suite;
    mmlu, wikifact and xsum need downloads, so they have no runs offline)."""
    from helm.benchmark.presentation.run_entry import read_run_entries
    from helm.benchmark.run import run_entries_to_run_specs

    import flexgen_helm.helm.plugin  # noqa: F401  (registers our deployments, which the run specs name)

    _, suite_dir = suite
    specs = run_entries_to_run_specs(read_run_entries([str(PAPER_CONF)]).entries, models_to_run=[DEPLOYMENTS[0]])
    assert {s.name.split(":")[0] for s in specs} == {"mmlu", "synthetic_reasoning", "synthetic_reasoning_natural",
                                                     "wikifact", "summarization_xsum"}
    schema = json.loads((suite_dir / "schema.json").read_text())
    groups = {g["name"]: g for g in schema["run_groups"]}
    metrics = {m["name"] for m in schema["metrics"]}
    for group in {g for s in specs for g in s.groups}:
        assert group in groups, group
        assert groups[group]["environment"]["main_name"] in metrics, group
    paper = groups["flexgen_paper"]
    assert set(paper["subgroups"]) == {g for s in specs for g in s.groups} - {"synthetic_reasoning"}
    tables = json.loads((suite_dir / "groups" / "flexgen_paper.json").read_text())
    assert [h["value"] for h in tables[0]["header"]] == PAPER_COLUMNS
    rows = tables[0]["rows"]
    assert [(row[0]["value"], row[1]["value"]) for row in rows] == [(display_names()[d], p)
                                                                    for d, p in zip(DEPLOYMENTS, PRECISIONS)]
    pattern_match = PAPER_COLUMNS.index("Pattern match - EM")
    assert all(0.0 <= row[pattern_match]["value"] <= 1.0 for row in rows)


METHOD_LABELS = {"rtn": "", "hqq": " HQQ-style", "gptq": " GPTQ", "gguf": " GGUF codes"}


def compression_label(policy) -> str:
    """What a deployment's display name must say about how it stores weights and cache."""
    policy = policy if isinstance(policy, dict) else {}
    weight, cache = policy.get("compress_weight"), policy.get("compress_cache")
    if not weight and not cache:
        return "uncompressed"
    if weight and cache and weight["bits"] == cache["bits"]:
        # a fitted quantizer is named (the cache stays round-to-nearest)
        return f"{weight['bits']}-bit" + METHOD_LABELS[weight.get("method", "rtn")]
    return ", ".join(f"{c['bits']}-bit {what}" for what, c in (("weights", weight), ("KV cache", cache)) if c)


def test_every_deployment_names_its_compression():
    names = display_names()
    for d in _yaml("model_deployments.yaml")["model_deployments"]:
        label = compression_label(d["client_spec"]["args"].get("policy"))
        assert f", {label} (FlexGen)" in names[d["model_name"]], (d["name"], label)


def test_screenshot_of_the_leaderboard(suite, tmp_path):
    if screenshot.find_browser() is None:
        pytest.skip(f"no Chromium on PATH ({', '.join(screenshot.BROWSERS)}): {screenshot.INSTALL_HINT}")
    out, suite_dir = suite
    rows = leaderboard.row_names(leaderboard.groups_json(suite_dir))
    assert "No screenshot" in "\n".join(leaderboard.leaderboard_section(suite_dir, tmp_path))
    png = screenshot.leaderboard_screenshot(out, "t", tmp_path / leaderboard.PNG_NAME, rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the report embeds the picture of this summary
    assert f"]({leaderboard.PNG_NAME})" in "\n".join(leaderboard.leaderboard_section(suite_dir, tmp_path))
    with pytest.raises(BrowserError, match=r"did not render rows \['no such deployment'\]"):
        screenshot.leaderboard_screenshot(out, "t", tmp_path / "x.png", ["no such deployment"])


def test_no_browser_and_no_suite_are_errors_that_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrowserError, match="no Chromium on PATH .*apt-get install -y chromium"):
        screenshot.leaderboard_screenshot(tmp_path, "t", tmp_path / "x.png", ["a"])
    with pytest.raises(FlexGenError, match=f"no HELM suite at {tmp_path / 'runs' / 'nope'}"):
        leaderboard.make_leaderboard(tmp_path, "nope", tmp_path)
