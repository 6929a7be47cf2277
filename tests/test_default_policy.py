"""The default policy (planner/auto.py): the fields the user sets as set, the planner's choice
for the workload of the command for the rest (eval, generate, bench, the HELM deployments);
the engine's fixed default, said in one line, where no profile is saved; float32 results
that do not depend on the block chosen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARED_DATA

from flexgen_helm.cli import build_parser
from flexgen_helm.cli.options import policy_from_args
from flexgen_helm.engine import Engine
from flexgen_helm.evaluation import lambada
from flexgen_helm.evaluation.run import run_eval
from flexgen_helm.models.opt import config_for_size
from flexgen_helm.planner import hardware_profile
from flexgen_helm.planner.auto import HELM_BATCH, HELM_NEW_TOKENS, HELM_PROMPT_TOKENS, CommandWorkload, policy_for_model
from flexgen_helm.planner.hardware_profile import DeviceSpeeds, HardwareProfile, default_profile_path
from flexgen_helm.planner.search import SearchOptions, default_budgets, search
from flexgen_helm.policy import Compression, Policy, Split

GIB = 2**30
OPT13 = config_for_size("1.3b")


def synthetic_profile() -> HardwareProfile:
    """A CPU whose matmuls get faster with more rows and whose layers have a fixed cost per
    GPU batch: small blocks are slow, as on a real one."""
    fixed = {"per_layer_batch": 5e-4, "per_step": 1e-3}
    cpu = DeviceSpeeds(matmul_flops={"bfloat16": {1: 2e9, 16: 30e9, 256: 200e9, 4096: 300e9}},
                       fixed_costs={"opt": {"prefill": fixed, "decode": fixed}},
                       int4_matmul_flops={1: 2e9, 128: 100e9, 512: 120e9}, int4_dequant_elems_per_s=1e9)
    return HardwareProfile(devices={"cpu": cpu}, memcpy_bytes_per_s=5e9, disk_read_bytes_per_s=1e9,
                           disk_write_bytes_per_s=5e8, cpu_mem_bytes=24 * GIB, cpu_available_bytes=20 * GIB,
                           disk_free_bytes=100 * GIB)


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A profile folder of this test's own (other tests save synthetic profiles in the session's)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLEXGEN_HELM_CACHE", str(cache))
    return cache


@pytest.fixture
def profiled(own_cache) -> HardwareProfile:
    profile = synthetic_profile()
    profile.save(default_profile_path())
    return profile


def bench_args(*flags: str):
    return build_parser().parse_args(["bench", "--model", "facebook/opt-1.3b", "--dummy", "--prompt-len", "64",
                                      "--gen-len", "1", "--dtype", "bfloat16", *flags])


def test_the_default_is_the_planners_block_for_the_workload(profiled, capsys):
    policy = policy_from_args(bench_args())
    expected = search(OPT13, profiled, 64, 1, default_budgets(profiled), SearchOptions()).policy
    assert policy == expected and policy.block_size > 1  # fixed costs per GPU batch: one sequence is slow
    assert "planned policy for" in capsys.readouterr().err
    assert policy_from_args(bench_args()) == policy  # a function of the profile: reruns plan the same block


def test_flags_the_user_gives_win_and_the_planner_fills_the_rest(profiled, tmp_path, capsys):
    only_gbs = policy_from_args(bench_args("--gpu-batch-size", "3"))
    assert only_gbs.gpu_batch_size == 3
    assert only_gbs == search(OPT13, profiled, 64, 1, default_budgets(profiled), SearchOptions(gpu_batch_size=3)).policy

    placed = Policy(3, 2, weights=Split(0, 1, 0), cache=Split(0, 1, 0))
    flags = ("--gpu-batch-size", "3", "--num-gpu-batches", "2", "--percent", "0", "100", "0", "100", "100", "0")
    capsys.readouterr()
    assert policy_from_args(bench_args(*flags)) == placed
    assert capsys.readouterr().err == ""  # nothing left open: no search

    compressed = policy_from_args(bench_args("--compress-weight", "--percent", "0", "100", "100", "0", "100", "0"))
    assert compressed.compress_weight == Compression(4, 64) and compressed.weights == Split(0, 1, 0)

    one_prompt = build_parser().parse_args(["generate", "--model", "facebook/opt-1.3b", "--dummy", "--prompt", "hi",
                                            "--gpu-batch-size", "4"])
    assert policy_from_args(one_prompt).block_size == 4  # more than the one sequence, as the user asked

    file = tmp_path / "policy.json"
    file.write_text(placed.to_json())
    from_file = policy_from_args(bench_args("--policy", str(file), "--num-gpu-batches", "5"))
    assert from_file == Policy(3, 5, weights=Split(0, 1, 0), cache=Split(0, 1, 0))


def test_without_a_saved_profile_the_default_says_so_and_measures_nothing(own_cache, capsys, monkeypatch):
    monkeypatch.setattr(hardware_profile, "measure", lambda *a, **k: pytest.fail("the default must not profile"))
    assert policy_from_args(bench_args("--gpu-batch-size", "2")) == Policy(gpu_batch_size=2)
    err = capsys.readouterr().err
    assert "no hardware profile" in err and "flexgen-helm profile" in err and "gbs=2 x nb=1" in err
    assert not default_profile_path().exists()


def test_policy_auto_profiles_a_machine_without_a_profile(own_cache, monkeypatch):
    profile = synthetic_profile()
    monkeypatch.setattr(hardware_profile, "measure", lambda *a, **k: profile)
    policy = policy_from_args(bench_args("--policy", "auto"))
    assert default_profile_path().exists()
    assert policy == search(OPT13, profile, 64, 1, default_budgets(profile), SearchOptions()).policy


def test_eval_plans_for_the_passages_it_will_score(tiny_llama, tmp_path):
    texts = ["the cat sat on the mat", "a dog ran far away over the green hills today", "open the door"]
    (tmp_path / "lambada").mkdir()
    (tmp_path / "lambada" / "lambada_openai_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                                            for t in texts))
    args = build_parser().parse_args(["eval", "--model", str(tiny_llama), "--task", "lambada", "--data", str(tmp_path),
                                      "--device", "cpu", "--dtype", "float32", "--quiet"])
    seen = []
    record = run_eval(args, lambda workload: seen.append(workload) or Policy(gpu_batch_size=2), [])
    items, _ = lambada.prepare(Engine.load(str(tiny_llama), progress=False).tokenizer, texts)
    assert seen == [CommandWorkload(max(len(it.full) for it in items), 1, len(texts))]  # scoring: a prefill
    assert record["policy"]["gpu_batch_size"] == 2


def test_helm_deployments_default_to_the_planners_block(profiled):
    import yaml

    from flexgen_helm.helm import engines

    cfg = config_for_size("125m")
    expected = search(cfg, profiled, HELM_PROMPT_TOKENS, HELM_NEW_TOKENS, default_budgets(profiled),
                      SearchOptions(max_block_size=HELM_BATCH)).policy
    planned = policy_for_model("facebook/opt-125m", dummy=True)
    assert planned == expected and planned.block_size > 1
    assert policy_for_model("facebook/opt-125m", dummy=True) == planned  # the same block: -n 1 and -n 16 alike
    pinned = {"gpu_batch_size": 4, "num_gpu_batches": 2, "weights": {"gpu": 0.0, "cpu": 1.0, "disk": 0.0}}
    assert policy_for_model("facebook/opt-125m", dummy=True, pinned=pinned) == Policy(4, 2, weights=Split(0, 1, 0))

    # the shipped SmolLM2 deployments set no block: the planner's, with their compression kept
    path = Path(engines.__file__).with_name("model_deployments.yaml")
    shipped = {d["name"]: d["client_spec"]["args"] for d in yaml.safe_load(path.read_text())["model_deployments"]}
    plain = engines.resolve_load_args("smollm2-135m", "flexgen/smollm2-135m", policy=shipped[
        "flexgen/smollm2-135m"].get("policy"))
    assert plain.policy_json is None and not plain.auto
    four = engines.resolve_load_args("smollm2-135m", "flexgen/smollm2-135m-4bit",
                                     policy=shipped["flexgen/smollm2-135m-4bit"]["policy"])
    assert "gpu_batch_size" not in json.loads(four.policy_json)
    assert json.loads(four.policy_json)["compress_weight"]["bits"] == 4


@pytest.mark.skipif(not (SHARED_DATA / "lambada").is_dir(), reason="LAMBADA data not in ../shared/data")
def test_float32_lambada_results_do_not_depend_on_the_block(tmp_path):
    """The real SmolLM2 on 5 LAMBADA passages (63 to 99 tokens), float32: every passage's
    correctness and last-word NLL are the same whatever block the planner (or the user)
    picks (one sequence, GPU batches of 3 with a short last one, one of all 5, and blocks of
    2 GPU batches of 2, the second with one of one sequence)."""
    from flexgen_helm.data.sources import read_lambada

    texts = read_lambada(None)[0][:5]
    engine = Engine.load("smollm2-135m", Policy(), dtype="float32", device="cpu", offload_dir=tmp_path,
                         progress=False)
    items, _ = lambada.prepare(engine.tokenizer, texts)
    runs = []
    for policy in (Policy(), Policy(gpu_batch_size=3), Policy(gpu_batch_size=12), Policy(2, 2)):
        engine.set_policy(policy)  # a block planned for the requests at hand, as a HELM scenario's is
        runs.append(lambada.evaluate(engine, items, 5, progress=False))
    for run in runs[1:]:
        assert run["correct"] == runs[0]["correct"]
        assert run["nll"] == pytest.approx(runs[0]["nll"], abs=1e-4)
