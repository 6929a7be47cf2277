"""`helm-run` end to end, offline: the plugin is found through its entry point alone.

With the real engine and SmolLM2-135M on a few instances of lambada, wikitext and
synthetic_reasoning (checking the stats HELM writes, the cache, and the token logprobs
against engine.score), and with the fake engine for the BatchingRunner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("helm")

TESTS = Path(__file__).resolve().parent
ENTRIES = [
    "lambada:model=flexgen/smollm2-135m",
    "wikitext:model=flexgen/smollm2-135m,unit=paragraph",
    "synthetic_reasoning:mode=pattern_match,model=flexgen/smollm2-135m",
]


def helm_run_args(tmp: Path, entries, *extra, fake=False, engine_factory=None, suite="t", max_instances=3,
                  launcher=None, output_path=None, env=None) -> tuple[list[str], dict]:
    """helm-run's command line and environment: its outputs in tmp/out (or `output_path`), its
    prod_env in tmp/prod_env; `fake`: the fake engine, `engine_factory` ("module:function" in
    tests/): another loader."""
    env = dict(env or os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("FLEXGEN_HELM_ENGINE_FACTORY", None)
    # helm-run's own folder heads its sys.path, not the working directory: the flexgen_helm
    # under test first, not an installed one (an editable install may be another checkout's)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    engine_factory = "helm_fake_engine:load" if fake else engine_factory
    if engine_factory:
        env["FLEXGEN_HELM_ENGINE_FACTORY"] = engine_factory
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    helm_run_bin = Path(sys.executable).parent / "helm-run"
    cmd = [*(launcher or [str(helm_run_bin)]), "-r", *entries, "-m", str(max_instances), "--suite", suite,
           "-o", str(output_path or tmp / "out"), "--local-path", str(tmp / "prod_env"), "-n", "4",
           "--exit-on-error", *extra]
    return cmd, env


def helm_run_process(tmp: Path, entries, *extra, cwd=None, **kwargs) -> subprocess.CompletedProcess:
    """helm-run (see helm_run_args), to its end."""
    cmd, env = helm_run_args(tmp, entries, *extra, **kwargs)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=cwd)


def helm_run(tmp: Path, entries, *extra, **kwargs) -> str:
    """helm-run_process that must succeed; its output."""
    proc = helm_run_process(tmp, entries, *extra, **kwargs)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def stats(run_dir: Path) -> dict:
    out = {}
    for s in json.loads((run_dir / "stats.json").read_text()):
        n = s["name"]
        if n.get("split") == "test" and "perturbation" not in n and s.get("count"):
            out[n["name"]] = s["mean"]
    return out


def run_dirs(tmp: Path, suite="t", deployment=None) -> dict:
    """scenario name -> run folder of the suite in tmp/out; `deployment`: its runs alone (in a
    suite of several deployments)."""
    root = tmp / "out" / "runs" / suite
    model = f"model={deployment.replace('/', '_')}" if deployment else ""
    return {p.name.split(":")[0]: p for p in root.iterdir() if ":" in p.name and p.name.endswith(model)}


def test_helm_run_smollm2_lambada_wikitext(tmp_path):
    """(synthetic_reasoning with the real engine: test_a_few_shot_run_computes_its_shared_examples_once)
    Two instances of each scenario: a batch of two, each scored or generated in full."""
    helm_run(tmp_path, ENTRIES[:2], max_instances=2)
    runs = run_dirs(tmp_path)
    assert set(runs) == {"lambada", "wikitext"}

    lam = stats(runs["lambada"])
    assert 0.0 <= lam["prefix_exact_match"] <= 1.0 and lam["num_output_tokens"] > 0
    wiki = stats(runs["wikitext"])
    assert 1.0 < wiki["perplexity"] < 1e4 and wiki["bits_per_byte"] > 0
    assert wiki["num_perplexity_tokens"] > 0 and wiki["num_bytes"] > 0

    # Token alignment: one Token per prompt token, logprobs = engine.score of the same ids.
    from flexgen_helm.engine import Engine
    from flexgen_helm.helm.tokens import helm_texts
    from flexgen_helm.text import token_text_for

    # HELM's cache: the same runs again compute nothing. That helm-run starts now, and its
    # start (imports, HELM's configuration: one core's work) overlaps the checks in this process.
    cmd, env = helm_run_args(tmp_path, ENTRIES[:2], suite="t2", max_instances=2)
    again = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        state = json.loads((runs["wikitext"] / "scenario_state.json").read_text())
        rs = state["request_states"][0]
        tokens = rs["result"]["completions"][0]["tokens"]
        engine = Engine.load("smollm2-135m")
        ids = engine.tokenizer.encode(rs["request"]["prompt"], add_special_tokens=False)
        assert [t["text"] for t in tokens] == helm_texts(token_text_for(engine.tokenizer), ids)
        direct = engine.score([ids]).results[0].logprobs
        assert [t["logprob"] for t in tokens][1:] == pytest.approx(direct[1:], abs=2e-3)
        assert rs["result"]["completions"][0]["finish_reason"]["flexgen"]["prompt_tokens"] == len(ids)
    except BaseException:
        again.kill()
        raise
    finally:
        log = again.communicate(timeout=300)[0]
    assert again.returncode == 0, log[-8000:]
    computes = [line for line in log.splitlines() if "flexgen.sqlite" in line and "computes" in line]
    assert computes and all(line.rstrip().endswith(" 0 computes") for line in computes), computes


def test_batching_runner_hands_the_whole_run_to_the_engine(fake_helm_suite):
    """(the session's helm-run with --runner-class-name BatchingRunner: conftest.fake_helm_suite)"""
    runs = run_dirs(fake_helm_suite, deployment="flexgen/smollm2-135m")
    padding = json.loads((runs["lambada"] / "flexgen_padding.json").read_text())
    # the three requests share batches (helm/batching.py), not one engine call each, and the
    # engine pads each of a batch's GPU batches by at most 4% of its prompts
    assert padding["requests"] == 3 and padding["batches"] < 3
    assert padding["padded_prompt_tokens"] <= 1.04 * padding["prompt_tokens"]
    lam = stats(runs["lambada"])
    assert lam["batch_size"] > 1  # the mean over requests of the batch each ran in
    assert stats(runs["wikitext"])["num_perplexity_tokens"] > 0


FEW_SHOT_NEW_TOKENS = 16


def test_a_few_shot_run_computes_its_shared_examples_once(tmp_path, monkeypatch):
    """synthetic_reasoning puts the same instructions and five examples before every
    question: with prefix sharing each batch computes them once, and every completion is
    the one computed without sharing (float32). The block is left to the planner (a saved
    profile), which plans it for the scenario's requests, shared prefix included, and says so.
    Both deployments (sharing on, and the comparison's `prefix_sharing: false` one) in one helm-run.
    16 new tokens a completion (num_output_tokens; the scenario's own 50 are decode steps of
    the same kind: each reads the shared prefix's one copy)."""
    from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile
    from flexgen_helm.tools.compare.helm_clients import prod_env_yaml

    sharing = {"flexgen/smollm2-135m-fp32": True, "flexgen/smollm2-135m-fp32-no-sharing": False}
    entries = [f"synthetic_reasoning:mode=pattern_match,model={d},num_output_tokens={FEW_SHOT_NEW_TOKENS}"
               for d in sharing]
    # the planner's profile in a cache of this test's own (the stores already converted reused)
    session_cache = Path(os.environ["FLEXGEN_HELM_CACHE"])
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry_dir in session_cache.glob("*"):
        if entry_dir.is_dir():
            (cache / entry_dir.name).symlink_to(entry_dir)
    speeds = DeviceSpeeds(matmul_flops={"float32": {1: 2e9, 16: 30e9, 256: 100e9}}, attn_prefill_flops=50e9,
                          attn_decode_bytes_per_s=5e9)
    HardwareProfile(devices={"cpu": speeds}, cpu_mem_bytes=8 << 30, cpu_available_bytes=8 << 30,
                    disk_free_bytes=0).save(cache / "hardware.json")
    monkeypatch.setenv("FLEXGEN_HELM_CACHE", str(cache))
    (tmp_path / "prod_env").mkdir()
    for name, text in prod_env_yaml(tmp_path / "no-hf-checkpoint").items():  # only HELM's HF client reads it
        (tmp_path / "prod_env" / name).write_text(text)
    log = helm_run(tmp_path, entries, "--runner-class-name", "flexgen_helm.helm.runner.BatchingRunner",
                   max_instances=3)
    planned = [line for line in log.splitlines() if "block for this scenario" in line]
    assert len(planned) == 2 and "shared prefix" in planned[0] and "prefix sharing off" in planned[1], planned
    runs = {d: p for p in (tmp_path / "out" / "runs" / "t").iterdir() for d in sharing
            if p.name.endswith(f"model={d.replace('/', '_')},num_output_tokens={FEW_SHOT_NEW_TOKENS}")}
    assert len(runs) == 2, runs
    outputs = {}
    for deployment, run in runs.items():
        state = json.loads((run / "scenario_state.json").read_text())
        sr = stats(run)
        assert "exact_match" in sr and sr["batch_size"] >= 1
        outputs[sharing[deployment]] = ([rs["result"]["completions"][0]["text"] for rs in state["request_states"]],
                                        json.loads((run / "flexgen_padding.json").read_text()))
        assert {len(rs["result"]["completions"][0]["tokens"]) for rs in state["request_states"]} <= {
            *range(1, FEW_SHOT_NEW_TOKENS + 1)}
    (shared, shared_padding), (plain, plain_padding) = outputs[True], outputs[False]
    assert shared == plain
    assert plain_padding["computed_prompt_tokens"] == plain_padding["padded_prompt_tokens"]
    assert shared_padding["prefix_reuse"] > 0.5  # the examples are most of each prompt
