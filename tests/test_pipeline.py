"""Pipeline parallelism over processes (torchrun, or torch's variables set by hand; gloo): the
same tokens as one process, prompts that share a prefix computed as one process computes
them (the prefix once per block in every stage), and a failing stage ends every rank
instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port

from flexgen_helm.engine import Engine
from flexgen_helm.executor.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["hello world", "abc", "a much longer prompt here", "xyz", "0123456789"]
ARGS = ["--dtype", "float32", "--max-new-tokens", "5", "--gpu-batch-size", "1", "--num-gpu-batches", "2",
        "--percent", "40", "30", "0", "50", "100", "0"]


def run_generate(model, out, tmp_path, procs: int, extra=(), timeout=240, prompts=PROMPTS, torchrun=True):
    """`flexgen-helm generate --pipeline` in `procs` processes: under torchrun, or (`torchrun`
    false) started here with the variables torchrun gives them, as srun's tasks are, which
    spares the launcher's own start (seconds of importing torch) where the launcher is not
    what a test is about."""
    argv = ["-m", "flexgen_helm", "generate", "--pipeline", "--model", str(model), "--prompt", *prompts, *ARGS,
            "--offload-dir", str(tmp_path / "offload"), "--json", str(out), *extra]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
               str(free_port()), *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ})
    return run_ranks(argv, procs, tmp_path, timeout)


def run_ranks(argv, procs: int, tmp_path, timeout) -> subprocess.CompletedProcess:
    """`python *argv` in `procs` processes started here with the variables torchrun gives its
    ranks (as srun's tasks get them): their output in tmp_path/rank-R.log, to the first
    failure (the others are then ended) or all ends."""
    port = free_port()
    logs = [tmp_path / f"rank-{r}.log" for r in range(procs)]  # files, not pipes: no rank blocks on a full one
    # a script's own folder heads its sys.path, not the working directory: the checkout's flexgen_helm first
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    ranks = []
    for r, log in enumerate(logs):
        env = {**os.environ, "PYTHONPATH": path,
               **{k: str(v) for k, v in dict(RANK=r, LOCAL_RANK=r, WORLD_SIZE=procs, LOCAL_WORLD_SIZE=procs,
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items()}}
        with open(log, "w") as f:
            ranks.append(subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    try:  # until all end, one fails (the others would wait for it in gloo) or the time is up
        while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
            if any(rank.poll() not in (None, 0) for rank in ranks):
                break
            time.sleep(0.1)
    finally:
        for rank in ranks:  # a rank left waiting for a failed one: ended, not leaked
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    codes = [rank.returncode for rank in ranks]
    output = "".join(f"--- rank {r} ---\n{log.read_text()}" for r, log in enumerate(logs))
    return subprocess.CompletedProcess(argv, next((c for c in codes if c != 0), 0), output, output)


def generate_in_this_process(model, out, tmp_path, extra=(), prompts=PROMPTS) -> None:
    """The one-process reference: the same `flexgen-helm generate` command line, run by the CLI's
    main in this (pytest's) process rather than a fresh interpreter (whose start, importing
    torch and transformers, is most of a tiny model's run). What a saved profile sets for the
    process (kernel crossovers, disk reads in flight) is put back after it; the stores go to the
    session's cache (conftest._isolated_cache, which module fixtures run before)."""
    from flexgen_helm import dense_linear
    from flexgen_helm.cli import main
    from flexgen_helm.compression import int4, int8
    from flexgen_helm.memory import direct_io

    argv = ["generate", "--model", str(model), "--prompt", *prompts, *ARGS, "--offload-dir",
            str(tmp_path / "offload"), "--json", str(out), *extra]
    tables = (int4.MAX_KERNEL_ROWS, int8.MAX_KERNEL_ROWS, dense_linear.FLIPPED_ROWS)
    before = [dict(table) for table in tables]
    reads_in_flight = direct_io.reads_in_flight()
    basetemp = tmp_path.parent  # pytest's base temp: tmp_path is one of its folders
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("FLEXGEN_HELM_CACHE", str(basetemp / "flexgen-cache"))
            env.setenv("FLEXGEN_HELM_OFFLOAD", str(basetemp / "offload"))
            assert main(argv) == 0
    finally:
        for table, saved in zip(tables, before):
            table.clear()
            table.update(saved)
        direct_io.set_reads_in_flight(reads_in_flight)


def completion_tokens(path):
    return [[c["token_ids"] for c in r["completions"]] for r in json.loads(path.read_text())["results"]]


def completion_logprobs(path):
    return [lp for r in json.loads(path.read_text())["results"] for c in r["completions"] for lp in c["logprobs"]]


def prompt_stats(path) -> dict:
    stats = json.loads(path.read_text())["stats"]
    return {k: stats[k] for k in ("prompt_tokens", "padded_prompt_tokens", "computed_prompt_tokens", "blocks")}


@pytest.fixture(scope="module")
def single(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    out = tmp / "single.json"
    generate_in_this_process(tiny_llama, out, tmp)
    return completion_tokens(out)


@pytest.mark.parametrize("procs", [2, 3])
def test_pipeline_matches_single_process(tiny_llama, single, tmp_path, procs):
    """Two stages under torchrun; three started with torchrun's variables by hand (the
    launcher's own start, importing torch, is seconds; three stages are about the stages)."""
    out = tmp_path / "pipe.json"
    run = run_generate(tiny_llama, out, tmp_path, procs, torchrun=procs == 2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert completion_tokens(out) == single
    assert not any((tmp_path / "offload").rglob("run-*"))  # every stage cleaned up


def test_failing_stage_stops_every_rank(tiny_llama, tmp_path):
    # stage 1's offload directory is a file: it fails when it makes its disk cache,
    # while stage 0 waits to hear from it
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "stage-1").write_text("not a directory")
    run = run_generate(tiny_llama, tmp_path / "x.json", tmp_path, 2, timeout=200)
    assert run.returncode != 0
    assert "offload directory" in run.stderr
    assert not (tmp_path / "x.json").exists()


# ---- prompts that share a prefix (executor/shared_prefix.py) ----------------------------

# a few-shot run: the same examples, then each instance's own question (a byte-level
# tokenizer: a token a character); blocks of three GPU batches of one (5 prompts: a block of
# 3, one of 2): two stages run the first block as micro-batches of two batches and one
FEW_SHOT = [f"Q: 12+30=42. Q: 7+5=12. Q: 40+2=42. Q: {q}=" for q in ("3+4", "10+1", "8+18", "2+9", "6+0")]
FEW_SHOT_ARGS = ["--num-gpu-batches", "3"]


@pytest.fixture(scope="module")
def single_shared(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single-shared")
    out = tmp / "single.json"
    generate_in_this_process(tiny_llama, out, tmp, FEW_SHOT_ARGS, prompts=FEW_SHOT)
    stats = prompt_stats(out)
    assert stats["computed_prompt_tokens"] < stats["padded_prompt_tokens"]  # the prefix was shared
    return out


@pytest.fixture(scope="module")
def pipeline_unshared(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline-unshared")
    out = tmp / "pipe.json"
    run = run_generate(tiny_llama, out, tmp, 2, [*FEW_SHOT_ARGS, "--no-prefix-sharing"], prompts=FEW_SHOT,
                       torchrun=False)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = prompt_stats(out)
    assert stats["computed_prompt_tokens"] == stats["padded_prompt_tokens"]
    return out


@pytest.mark.parametrize("procs", [2, 3])
def test_a_pipeline_shares_prefixes_as_one_process_does(tiny_llama, single_shared, pipeline_unshared, tmp_path,
                                                        procs):
    """The same tokens and (float32) log-probs as one process sharing the prefix, and as the
    pipeline computing every prompt whole; the stats count the same prompt tokens as one
    process (the prefix once a block)."""
    out = tmp_path / "pipe.json"
    run = run_generate(tiny_llama, out, tmp_path, procs, FEW_SHOT_ARGS, prompts=FEW_SHOT, torchrun=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert completion_tokens(out) == completion_tokens(single_shared) == completion_tokens(pipeline_unshared)
    assert completion_logprobs(out) == pytest.approx(completion_logprobs(single_shared), abs=1e-5)
    assert completion_logprobs(out) == pytest.approx(completion_logprobs(pipeline_unshared), abs=1e-5)
    assert prompt_stats(out) == prompt_stats(single_shared)
    assert not any((tmp_path / "offload").rglob("run-*"))


def test_every_stage_computes_the_windows_and_the_prefix_once_and_decodes_over_its_one_copy(
        tiny_llama, tmp_path, monkeypatch):
    """Each stage's transformer blocks see at the prefill exactly the prompt tokens one
    process computes (the shared prefix once a block, then each GPU batch's window): a
    later stage gets the prefix's hidden states and the windows, not whole prompts. Its
    decode steps attend to the prefix's one copy for every sequence, as one process's do."""
    from pipeline_prefill_counts import POLICY

    from flexgen_helm.models import llama

    prompts = [[3, *range(40, 70), 7 + i, *range(100, 100 + i)] for i in range(6)]  # 31 shared, 1 to 6 own
    seen = []
    real = llama.finish_block
    monkeypatch.setattr(llama, "finish_block", lambda cfg, w, h, a: seen.append(h.shape[0] * h.shape[1]) or
                        real(cfg, w, h, a))
    one = Engine.load(str(tiny_llama), POLICY, dtype="float32", device="cpu", offload_dir=tmp_path / "single",
                      progress=False)
    prefill_calls = []

    def on_step(done: int, total: int) -> None:
        if done == 1:  # the prefill's step
            prefill_calls.append(len(seen))

    single = one.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True), on_step=on_step)
    cfg, stats = one.config, single.stats
    assert stats.computed_prompt_tokens < stats.padded_prompt_tokens
    assert sum(seen[:prefill_calls[0]]) == cfg.num_layers * stats.computed_prompt_tokens

    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    # three stages with torchrun's variables set by hand (the launcher is not what this is about)
    argv = [str(Path(__file__).parent / "pipeline_prefill_counts.py"), str(tiny_llama), str(tmp_path / "prompts.json"),
            "3", str(tmp_path / "out")]
    run = run_ranks(argv, 3, tmp_path, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    stages = [json.loads((tmp_path / "out" / f"rank-{r}.json").read_text()) for r in range(3)]
    assert sum(stage["blocks"] for stage in stages) == cfg.num_layers
    assert any(stage["blocks"] for stage in stages[1:])  # a later stage holds transformer blocks
    for stage in stages:
        assert stage["stats"]["computed_prompt_tokens"] == stats.computed_prompt_tokens
        assert stage["prefill_tokens"] == stage["blocks"] * stats.computed_prompt_tokens
        # the two decode steps after the prefill's token, every sequence's kv heads, in each block
        assert stage["decode_prefix_units"] == stage["blocks"] * 2 * len(prompts) * cfg.num_kv_heads
        assert stage["tokens"] == [r.completions[0].token_ids for r in single.results]
