"""Data-parallel HELM: two engine replicas (torchrun, gloo) share a run's requests, and
the run they produce is the one a single process produces."""

from __future__ import annotations

import json
import socket
import sys

import pytest
from test_helm_e2e import helm_run, run_dirs

pytest.importorskip("helm")
ENTRIES = ["lambada:model=flexgen/smollm2-135m", "synthetic_reasoning:mode=pattern_match,model=flexgen/smollm2-135m"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _completions(run_dir):
    state = json.loads((run_dir / "scenario_state.json").read_text())
    return [rs["result"]["completions"][0]["text"] for rs in state["request_states"]]


def test_two_replicas_give_the_single_process_run(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(_free_port()), "-m", "flexgen_helm.helm.data_parallel"]
    # the fake engine keeps this about the plumbing (the real one is tested end to end elsewhere)
    log = helm_run(tmp_path / "dp", ENTRIES, launcher=torchrun, max_instances=6, fake=True)
    helm_run(tmp_path / "single", ENTRIES, "--runner-class-name", "flexgen_helm.helm.runner.BatchingRunner",
             max_instances=6, fake=True)
    assert "rank 1 computed" in log and "rank 0 computed" in log
    dp, single = run_dirs(tmp_path / "dp"), run_dirs(tmp_path / "single")
    assert set(dp) == set(single) == {"lambada", "synthetic_reasoning"}
    for name in dp:
        assert _completions(dp[name]) == _completions(single[name])
        assert (dp[name] / "stats.json").exists()
