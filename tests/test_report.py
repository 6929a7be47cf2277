"""The report: built from a small fake HELM suite plus bench / eval JSONs, with known
numbers checked through the tables (padded vs actual arithmetic, efficiency, ratios)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from flexgen_helm.cli import main
from flexgen_helm.helm import accounting
from flexgen_helm.helm.accounting import BatchRecord
from flexgen_helm.policy.precision import setting_name
from flexgen_helm.tools.bench import EVENTS, breakdown
from flexgen_helm.tools.report import accuracy, frontier, helm_runs, placement
from flexgen_helm.tools.report import breakdown as breakdown_report
from flexgen_helm.tools.report.demo import helm_command, run_entries
from flexgen_helm.tools.report.markdown import table

FP = {"gpu_batch_size": 4, "num_gpu_batches": 2, "weights": {"gpu": 1.0, "cpu": 0.0, "disk": 0.0},
      "cache": {"gpu": 1.0, "cpu": 0.0, "disk": 0.0}, "activations": {"gpu": 1.0, "cpu": 0.0, "disk": 0.0},
      "overlap": True, "cpu_cache_compute": False, "pin_weight": True, "compress_weight": None,
      "compress_cache": None, "attn_sparsity": 1.0}
Q4 = {**FP, "compress_weight": {"bits": 4, "group_size": 64, "group_dim": None},
      "compress_cache": {"bits": 4, "group_size": 64, "group_dim": None}}
GIB = 2**30
Q4_MEMORY = {"tiers": {"gpu": {"peak_bytes": GIB // 2}, "cpu": {"peak_bytes": GIB // 4}, "disk": {"peak_bytes": 0}},
             "placement": {"weight_bytes": {"gpu": 0, "cpu": 0, "disk": 3 * GIB // 2}}, "cpu_peak_rss_bytes": 2 * GIB}


def _batch(id: str, size: int, time_s: float, padded_prompt: int, padded_gen: int) -> BatchRecord:
    """A batch whose engine spent a fifth of its time in prefill and half in decode."""
    return BatchRecord(id=id, mode="generate", size=size, time_s=time_s, prompt_tokens=0,
                       padded_prompt_tokens=padded_prompt, generated_tokens=0, padded_generated_tokens=padded_gen,
                       prefill_s=time_s / 5, decode_s=time_s / 2)


def _request(instance: str, prompt: int, gen: int, batch: BatchRecord, precision: str = "BF16",
             engine: accounting.EngineLoad | None = None) -> dict:
    """A request state as HELM writes it, with the accounting the HELM client reports."""
    rec = accounting.to_finish_reason(accounting.RequestRecord(prompt, gen, batch, engine=engine), precision)
    return {"instance": {"id": instance, "input": {"text": "x"}, "references": [], "split": "test"},
            "train_trial_index": 0,
            "result": {"success": True, "batch_size": batch.size, "batch_request_time": batch.time_s,
                       "completions": [{"text": "y", "finish_reason": {"flexgen": rec}}]}}


def _stat(name: str, mean: float, **extra) -> dict:
    return {"name": {"name": name, "split": "test", **extra}, "count": 1, "sum": mean, "mean": mean}


def _write_run(suite: Path, name: str, deployment: str, requests: list[dict], stats: list[dict]) -> None:
    d = suite / name
    d.mkdir(parents=True)
    (d / "run_spec.json").write_text(json.dumps({"name": name, "adapter_spec": {"model_deployment": deployment}}))
    (d / "scenario_state.json").write_text(json.dumps({"request_states": requests}))
    (d / "stats.json").write_text(json.dumps(stats))
    (d / "per_instance_stats.json").write_text("[]")


@pytest.fixture
def fixture_dirs(tmp_path) -> tuple[Path, Path]:
    suite = tmp_path / "benchmark_output" / "runs" / "mini"
    # batch 1: two requests, prompts 10 + 6 padded to 2 x 10, 4 tokens each; batch 2: one request
    b1 = _batch("b1", 2, 2.0, padded_prompt=20, padded_gen=8)
    b2 = _batch("b2", 1, 1.0, padded_prompt=8, padded_gen=4)
    _write_run(suite, "lambada:model=flexgen_m", "flexgen/m",
               [_request("i1", 10, 4, b1), _request("i2", 6, 4, b1), _request("i3", 8, 4, b2)],
               [_stat("prefix_exact_match", 0.5), _stat("exact_match", 0.25),
                _stat("prefix_exact_match", 0.1, perturbation={"name": "typos"}), _stat("perplexity", 3.0)])
    b3 = _batch("b3", 2, 4.0, padded_prompt=40, padded_gen=0)
    _write_run(suite, "wikitext:unit=paragraph,model=flexgen_m-4bit", "flexgen/m-4bit",
               [_request("w1", 20, 0, b3, "4-bit"), _request("w2", 20, 0, b3, "4-bit")],
               [_stat("perplexity", 12.5), _stat("bits_per_byte", 1.25)])
    (suite / "eval_cache").mkdir()  # HELM's own folders without a run_spec are not runs

    runs = tmp_path / "runs"
    (runs / "bench").mkdir(parents=True)
    (runs / "accuracy" / "json").mkdir(parents=True)
    timers = {"prefill_compute": 1.0, "prefill_load_weight": 0.5, "decode_compute": 2.0, "decode_load_cache": 0.25,
              "decode_store_cache": 0.25, "decode_load_hidden": 0.1, "decode_store_hidden": 0.1}
    benches = [("all optimizations", 8, 10.0, 4.0, FP), ("all optimizations", 16, 16.0, 6.0, FP),
               ("no overlap (sync I/O)", 8, 8.0, 5.0, {**FP, "overlap": False}), (None, 8, 5.0, 8.0, Q4)]
    for i, (label, batch, thr, lat, pol) in enumerate(benches):
        (runs / "bench" / f"{i}.json").write_text(json.dumps({
            "label": label, "model": "m", "policy": pol, "policy_summary": "p", "effective_batch_size": batch,
            "prompt_len": 32, "gen_len": 8, "total_latency_s": lat, "total_throughput": thr,
            "prefill_latency_s": 2.0, "decode_latency_s": 3.0, "timers": timers, "breakdown": breakdown(timers),
            **({"memory": Q4_MEMORY} if pol is Q4 else {})}))
    for name, pol, task, metrics, counts, limit in [
        ("fp-lambada", FP, "lambada", {"accuracy": 0.4}, {"passages": 100}, None),
        ("fp-lambada-lim", FP, "lambada", {"accuracy": 0.9}, {"passages": 10}, 10),
        ("fp-wiki", FP, "wikitext", {"token_perplexity": 20.0, "bits_per_byte": 1.1}, {"tokens": 1000}, None),
        ("q4-lambada", Q4, "lambada", {"accuracy": 0.35}, {"passages": 100}, None),
        ("q4-wiki", Q4, "wikitext", {"token_perplexity": 22.0, "bits_per_byte": 1.2}, {"tokens": 1000}, None)]:
        (runs / "accuracy" / "json" / f"{name}.json").write_text(json.dumps({
            "task": task, "model": "m", "dtype": "float32", "policy": pol, "metrics": metrics, "counts": counts,
            "limit": limit}))
    (runs / "broken.json").write_text("{not json")  # skipped, not fatal
    return suite, runs


def test_helm_table_padded_and_actual_throughput(fixture_dirs):
    suite, _ = fixture_dirs
    df = helm_runs.helm_table(suite)
    assert list(df["scenario"]) == ["lambada", "wikitext:unit=paragraph"]
    lam = df.iloc[0]
    assert lam["instances"] == 3 and lam["batches"] == 2
    assert (lam["precision"], df.iloc[1]["precision"]) == ("BF16", "4-bit")  # as the responses recorded it
    assert (lam["prompt tok"], lam["prompt tok (padded)"]) == (24, 28)
    assert (lam["output tok"], lam["output tok (padded)"]) == (12, 12)
    assert lam["engine time (s)"] == pytest.approx(3.0)
    # per-stage time: each batch once, though three requests carry the two batches
    assert (lam["prefill (s)"], lam["decode (s)"]) == (pytest.approx(0.6), pytest.approx(1.5))
    assert lam["padded tok/s"] == pytest.approx(40 / 3.0)
    assert lam["actual tok/s"] == pytest.approx(36 / 3.0)
    assert lam["efficiency"] == pytest.approx(0.9)
    assert lam["metric:prefix_exact_match"] == 0.5  # the perturbed 0.1 is not the main number
    wiki = df.iloc[1]
    assert wiki["efficiency"] == pytest.approx(1.0) and wiki["actual tok/s"] == pytest.approx(10.0)
    total = helm_runs.suite_total(df)
    assert total["efficiency"] == pytest.approx(76 / 80) and total["actual tok/s"] == pytest.approx(76 / 7.0)


def test_accuracy_tables(fixture_dirs):
    suite, runs = fixture_dirs
    from flexgen_helm.tools.report.records import eval_records, load_json_files

    ev = accuracy.eval_table(eval_records(load_json_files(runs)))
    full = ev[ev["scope"] == "full"].set_index("setting")
    assert list(full.index) == ["FP32", "4-bit"]
    assert full.loc["FP32", "LAMBADA acc"] == 0.4 and full.loc["4-bit", "WikiText ppl"] == 22.0
    assert ev[ev["scope"] == "subset"].iloc[0]["LAMBADA acc"] == 0.9
    helm = accuracy.helm_accuracy_table(helm_runs.helm_table(suite)).set_index("deployment")
    assert helm.loc["flexgen/m", "lambada prefix_exact_match"] == 0.5
    assert helm.loc["flexgen/m-4bit", "wikitext:unit=paragraph perplexity"] == 12.5
    assert helm.loc["flexgen/m-4bit", "precision"] == "4-bit"


def test_settings_are_named_as_in_the_paper():
    assert setting_name(FP, "bfloat16") == "BF16" and setting_name(Q4, "float16") == "4-bit"
    assert setting_name({**Q4, "attn_sparsity": 0.1}, "float16") == "4-bit-S"
    eight = {"bits": 8, "group_size": 64}
    assert setting_name({**FP, "compress_weight": eight, "compress_cache": eight}, "float32") == "8-bit"
    assert setting_name({**FP, "compress_weight": eight}, "float32") == "8-bit weights"
    hqq = {**Q4, "compress_weight": {**Q4["compress_weight"], "method": "hqq"}}
    assert setting_name(hqq, "bfloat16") == "4-bit hqq"  # not the same row as min/max 4-bit


def test_frontier_ablation_breakdown(fixture_dirs):
    _, runs = fixture_dirs
    from flexgen_helm.tools.report.records import bench_records, load_json_files

    benches = bench_records(load_json_files(runs))
    fr = frontier.frontier_table(benches)
    curves = fr.groupby("curve")["batch"].apply(list).to_dict()
    assert curves["all optimizations"] == [8, 16]
    assert any("W4 g64" in c for c in curves)  # unlabelled: named by its policy
    ab = frontier.ablation_table(benches).set_index("setting")
    assert ab.loc["all optimizations", "throughput (tok/s)"] == 16.0  # best batch
    assert ab.loc["no overlap", "vs all optimizations"] == pytest.approx(0.5)  # label matched by its prefix
    assert ab.loc["no overlap", "label"] == "no overlap (sync I/O)"
    assert ab.loc["no overlap", "workload"] == "m s=32 n=8, host not recorded"
    bd = breakdown_report.breakdown_table(benches)
    row = bd[(bd["setting"] == "no overlap (sync I/O)") & (bd["stage"] == "decode")].iloc[0]
    assert row["compute (s)"] == 2.0 and row["cache read (s)"] == 0.25 and row["activations (s)"] == pytest.approx(0.2)
    assert row["other (s)"] == pytest.approx(3.0 - 2.0 - 0.25 - 0.25 - 0.2)
    overlapped = bd[bd["overlap"]].iloc[0]
    assert pd.isna(overlapped["other (s)"])  # parts overlap: no remainder to speak of
    placed = placement.placement_table(benches)
    assert len(placed) == 1  # only the record that carries its memory use
    q4 = placed.iloc[0]
    assert q4["compression"] == "W4 g64 + KV4 g64" and q4["weights disk (GiB)"] == 1.5 and q4["weights gpu (GiB)"] == 0
    assert q4["peak cpu (GiB)"] == 0.25 and q4["RSS peak (GiB)"] == 2.0


def test_report_files(fixture_dirs, tmp_path):
    suite, runs = fixture_dirs
    out = tmp_path / "out"
    assert main(["report", str(suite), "--runs-dir", str(runs), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    for heading in ("Table 25", "Table 5", "Figure 1", "Table 23", "per tier", "Table 6"):
        assert heading in text
    assert "| lambada | flexgen/m | BF16 | 3 | 24 | 28 | 28 | 0 | 12 | 12 | 3 | 0.6 | 1.5 | 13.33 | 12 | 0.9 |" in text
    for name in ("helm_runs.csv", "accuracy_eval.csv", "accuracy_helm.csv", "frontier.csv", "breakdown.csv",
                 "placement.csv", "ablation.csv", "helm_throughput.png", "accuracy_eval.png", "accuracy_helm.png",
                 "frontier-1.png",
                 "breakdown.png"):
        assert (out / name).stat().st_size > 0, name
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pd.read_csv(out / "helm_runs.csv")["prefix_exact_match"].iloc[0] == 0.5


def test_report_by_suite_name_and_empty_sections(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmark_output" / "runs" / "empty").mkdir(parents=True)
    assert main(["report", "--suite", "empty"]) == 0
    text = (tmp_path / "runs" / "empty" / "report.md").read_text()
    assert "No HELM runs" in text and "flexgen-helm bench" in text  # each empty section says how to fill it


def test_markdown_and_demo_entries():
    md = table(pd.DataFrame({"a": [1, 2500], "b": [0.0123456, None], "c": ["x|y", "z"]}))
    assert "| 2,500 |" in md and "0.01235" in md and "x\\|y" in md
    entries = run_entries(("lambada", "wikitext:unit=paragraph"), ("flexgen/a",))
    assert entries == ["lambada:model=flexgen/a", "wikitext:unit=paragraph,model=flexgen/a"]
    cmd = helm_command(entries, 5, "s", "out", 2)
    assert cmd[cmd.index("-m") + 1] == "5" and "flexgen_helm.helm.runner.BatchingRunner" in cmd


def test_engine_times_each_event_without_overlap(tiny_llama, tmp_path):
    """The breakdown's source: with overlap off, every stage's events are timed and their
    sum stays within the stage's wall time. Half the cache on disk: a cache attention reads
    in place is written inside attention (compute), so only an offloaded one has store and
    load events of its own at decode."""
    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.policy.policy import Policy, Split

    policy = Policy(2, 2, cache=Split(0.5, 0.0, 0.5), overlap=False)
    engine = Engine.load(str(tiny_llama), policy, dtype="float32", device="cpu",
                         offload_dir=tmp_path, progress=False)
    prompts = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]
    run = engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    parts = breakdown(run.stats.timers)
    for stage, stage_s in (("prefill", run.stats.prefill_s), ("decode", run.stats.decode_s)):
        assert parts[stage]["compute"] > 0 and parts[stage]["load_weight"] > 0 and parts[stage]["store_cache"] > 0
        # the events, not their parts (decode's attention is of compute, unpack_cache of load_cache)
        assert sum(parts[stage][e] for e in EVENTS) <= stage_s * 1.05
    assert parts["decode"]["load_cache"] > 0


def _host(cpu: str) -> dict:
    return {"cpu": cpu, "cpu_cores": 2, "cpu_bf16_arithmetic": True}


def test_frontier_never_mixes_hosts_models_or_workloads(fixture_dirs):
    _, runs = fixture_dirs
    from flexgen_helm.tools.report.records import NO_HOST, bench_records, load_json_files

    benches = bench_records(load_json_files(runs))
    same = {k: v for k, v in benches[0].items() if k != "_path"}
    benches += [{**same, "hardware": _host("CPU A")}, {**same, "hardware": _host("CPU B")},
                {**same, "hardware": _host("CPU A"), "prompt_len": 64}]
    groups = {key: len(g) for key, g in frontier.frontier_groups(frontier.frontier_table(benches))}
    assert groups[(NO_HOST, "m", "prompt 32 / output 8")] == 4  # the fixture's own records say no host
    host_a = next(h for h, _, _ in groups if h.startswith("CPU A"))
    assert groups[(host_a, "m", "prompt 32 / output 8")] == 1
    assert groups[(host_a, "m", "prompt 64 / output 8")] == 1
    assert sum(1 for h, _, _ in groups if h.startswith("CPU B")) == 1


def test_suite_report_is_about_its_own_run_and_links_archives(fixture_dirs, tmp_path, monkeypatch):
    suite, runs = fixture_dirs
    (runs / "accuracy" / "README.md").write_text("# archived accuracy\n")
    out = runs / "mini"
    from flexgen_helm.tools.report.build import end_run_info, records_dir_of, write_run_info

    write_run_info(records_dir_of(out), ["flexgen-helm", "demo"])
    end_run_info(records_dir_of(out))
    assert main(["report", str(suite), "--archives", str(runs)]) == 0
    text = (out / "report.md").read_text()
    assert re.search(r"Load average \(1 min\) [0-9.]+ at its start, [0-9.]+ at its end", text)  # timings' context
    # the bench and eval records archived under runs/ are not this run's: no table of theirs
    assert "0 bench / 0 eval records" in text and "No bench records in this run" in text
    assert "Measured on **" in text and "`flexgen-helm demo`" in text  # the host and command of the run
    assert "## Archived results" in text and "(../accuracy/README.md)" in text


def test_report_of_a_missing_suite_names_the_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--suite", "nope"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "benchmark_output" / "runs" / "nope") in err


def test_a_rerun_counts_cached_requests_apart_and_no_throughput_mixes_them(tmp_path):
    """A second run in the same folder: HELM's cache answers every request, computed by the
    first run elsewhere; its report shows no throughput of its own, and says how many requests
    came from the cache, when and where they were computed. A run of both kinds measures only
    what it computed."""
    b1, b2 = _batch("b1", 2, 2.0, padded_prompt=20, padded_gen=8), _batch("b2", 1, 1.0, padded_prompt=8, padded_gen=4)
    fresh = [_request("i1", 10, 4, b1), _request("i2", 6, 4, b1), _request("i3", 8, 4, b2)]
    for rs in fresh:
        rs["result"]["completions"][0]["finish_reason"]["flexgen"]["host"] = "earlier-box (2 cores)"
        rs["result"]["request_datetime"] = 1_764_000_000  # 2025-11-24 16:00 UTC
    rerun = [{**rs, "result": {**rs["result"], "cached": True}} for rs in fresh]
    everything_cached = accounting.summarize(accounting.records_from_scenario_state({"request_states": rerun}))
    assert everything_cached["requests"] == 0 and everything_cached["cached_requests"] == 3
    assert everything_cached["actual_throughput_tok_s"] is None and everything_cached["engine_time_s"] == 0
    assert everything_cached["cached_computed"] == "computed 2025-11-24 16:00 UTC on earlier-box (2 cores)"
    # half and half: the throughput is the computed batch's alone
    mixed = accounting.summarize(accounting.records_from_scenario_state({"request_states": rerun[:2] + fresh[2:]}))
    assert mixed["requests"] == 1 and mixed["cached_requests"] == 2
    assert mixed["actual_throughput_tok_s"] == pytest.approx((8 + 4) / 1.0)
    # the report: the rerun's row shows the cached count, its provenance, and no tok/s
    suite = tmp_path / "benchmark_output" / "runs" / "again"
    _write_run(suite, "lambada:model=flexgen_m", "flexgen/m", rerun, [_stat("exact_match", 0.25)])
    row = helm_runs.helm_table(suite).iloc[0]
    assert row["cached requests"] == 3 and pd.isna(row["actual tok/s"])
    assert "earlier-box" in row["cached computed"]


def test_engine_loads_are_shown_apart_and_counted_once_per_engine(tmp_path):
    """An engine loaded once serves every scenario of its deployment in a helm-run: each of
    their rows shows its load, the whole suite counts it once, and no engine time or
    throughput includes it; a cached request's engine (an earlier run's) is not this run's."""
    e1, e2, old = (accounting.EngineLoad("e1", 2.0), accounting.EngineLoad("e2", 1.5),
                   accounting.EngineLoad("e0", 9.0))
    b1, b2, b3 = (_batch("b1", 2, 2.0, padded_prompt=20, padded_gen=8), _batch("b2", 1, 1.0, 8, 4),
                  _batch("b3", 1, 1.0, 8, 4))
    cached = _request("i0", 8, 4, _batch("b0", 1, 5.0, 8, 4), engine=old)
    cached["result"]["cached"] = True
    suite = tmp_path / "benchmark_output" / "runs" / "loads"
    _write_run(suite, "lambada:model=flexgen_m", "flexgen/m",
               [_request("i1", 10, 4, b1, engine=e1), _request("i2", 6, 4, b1, engine=e1), cached],
               [_stat("prefix_exact_match", 0.5)])
    _write_run(suite, "synthetic_reasoning:mode=pattern_match,model=flexgen_m", "flexgen/m",
               [_request("s1", 8, 4, b2, engine=e1)], [_stat("exact_match", 0.0)])
    _write_run(suite, "wikitext:unit=paragraph,model=flexgen_m-4bit", "flexgen/m-4bit",
               [_request("w1", 8, 4, b3, "4-bit", engine=e2)], [_stat("perplexity", 12.5)])
    df = helm_runs.helm_table(suite)
    assert list(df["engine load (s)"]) == [2.0, 2.0, 1.5]
    assert df.iloc[0]["engine time (s)"] == pytest.approx(2.0)  # the load in no engine time
    total = helm_runs.suite_total(df)
    assert total["engines loaded"] == 2 and total["engine load (s)"] == pytest.approx(3.5)
    assert total["engine time (s)"] == pytest.approx(4.0)
    # records of a plugin that wrote no engine entry: no load shown, nothing else changes
    plain = accounting.summarize(accounting.records_from_scenario_state(
        {"request_states": [_request("i1", 10, 4, b1), _request("i2", 6, 4, b1)]}))
    assert plain["engine_load_s"] is None and plain["engine_time_s"] == pytest.approx(2.0)
