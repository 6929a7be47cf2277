"""Pipeline parallelism over processes (torchrun, gloo): the same tokens as one process,
and a failing stage ends every rank instead of hanging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

PROMPTS = ["hello world", "abc", "a much longer prompt here", "xyz", "0123456789"]
ARGS = ["--dtype", "float32", "--max-new-tokens", "5", "--gpu-batch-size", "1", "--num-gpu-batches", "2",
        "--percent", "40", "30", "0", "50", "100", "0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_generate(model, out, tmp_path, procs: int | None, extra=(), timeout=240):
    cmd = [sys.executable, "-m", "flexgen_helm", "generate", "--model", str(model), "--prompt", *PROMPTS,
           *ARGS, "--offload-dir", str(tmp_path / "offload"), "--json", str(out), *extra]
    if procs is not None:
        cmd[1:3] = ["-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
                    str(_free_port()), "-m", "flexgen_helm"]
        cmd.insert(cmd.index("generate") + 1, "--pipeline")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ})


def completion_tokens(path):
    return [[c["token_ids"] for c in r["completions"]] for r in json.loads(path.read_text())["results"]]


@pytest.fixture(scope="module")
def single(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    out = tmp / "single.json"
    run = run_generate(tiny_llama, out, tmp, None)
    assert run.returncode == 0, run.stderr[-2000:]
    return completion_tokens(out)


@pytest.mark.parametrize("procs", [2, 3])
def test_pipeline_matches_single_process(tiny_llama, single, tmp_path, procs):
    out = tmp_path / "pipe.json"
    run = run_generate(tiny_llama, out, tmp_path, procs)
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
