"""Data-parallel HELM: two engine replicas (torchrun, gloo) share a run's requests, and
the run they produce is the one a single process produces."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import sys
from pathlib import Path

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


def test_two_replicas_give_the_single_process_run(tmp_path, fake_helm_suite):
    """The single process's run: the session's (conftest.fake_helm_suite: BatchingRunner, the
    same three instances of each scenario). The replicas' fake engines take blocks of 2
    (FLEXGEN_FAKE_BLOCK): each scenario's three requests are two batches, one a rank, so
    that rank 1's results reach the run too."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(_free_port()), "-m", "flexgen_helm.helm.data_parallel"]
    # the fake engine keeps this about the plumbing (the real one is tested end to end elsewhere)
    log = helm_run(tmp_path / "dp", ENTRIES, launcher=torchrun, max_instances=3, fake=True,
                   env=dict(os.environ, FLEXGEN_FAKE_BLOCK="2"))
    assert "rank 1 computed" in log and "rank 0 computed" in log
    assert re.search(r"rank 1 computed [1-9]", log) and re.search(r"rank 0 computed [1-9]", log), log[-3000:]
    dp, single = run_dirs(tmp_path / "dp"), run_dirs(fake_helm_suite, deployment="flexgen/smollm2-135m")
    assert set(dp) == {"lambada", "synthetic_reasoning"} and set(dp) <= set(single)
    for name in dp:
        assert _completions(dp[name]) == _completions(single[name])
        assert (dp[name] / "stats.json").exists()


def _prefetch_on_rank(rank, world, tmp, batch_sizes=(2, 2)):
    """One rank of test_each_round_of_batches_is_in_rank_0s_cache_before_the_next_starts;
    batch_sizes: each rank's deployment's max_batch_size (what its own plan would cut by)."""
    os.environ["FLEXGEN_HELM_ENGINE_FACTORY"] = "helm_fake_engine:load"
    import torch.distributed as dist
    from helm.common.cache import SqliteCacheConfig
    from helm.common.key_value_store import SqliteKeyValueStore
    from helm.common.request import Request

    from flexgen_helm.helm.client import FlexGenClient
    from flexgen_helm.helm.data_parallel import prefetch_data_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # ranks out of step fail, never hang
    cache = tmp / ("cache.sqlite" if rank == 0 else f"rank-{rank}.sqlite")  # rank 0's is the user's
    client = FlexGenClient(SqliteCacheConfig(str(cache)), model="smollm2-135m", deployment="flexgen/smollm2-135m",
                           max_batch_size=batch_sizes[rank])

    def cached_so_far():
        with SqliteKeyValueStore(str(tmp / "cache.sqlite")) as store:
            return len(list(store.get_all()))

    seen = []  # rank 0's cache when each of its batches starts
    client.handle.engine.on_call = lambda calls: seen.append(cached_so_far())
    requests = [Request(model="flexgen/smollm2-135m", model_deployment="flexgen/smollm2-135m",
                        prompt=f"say {c}", temperature=0.0, max_tokens=2) for c in "abcdefghijkl"]
    computed = prefetch_data_parallel(client, requests)
    (tmp / f"rank-{rank}.json").write_text(json.dumps({"computed": computed, "seen": seen,
                                                      "cached_at_end": cached_so_far()}))
    dist.destroy_process_group()


def test_each_round_of_batches_is_in_rank_0s_cache_before_the_next_starts(tmp_path, monkeypatch):
    """12 requests in 6 batches of 2, two ranks: three rounds, and each round's 4 results
    (both ranks') are in rank 0's cache before its next batch starts, as a single process
    caches each batch as it ends: a killed run loses at most the round in progress."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    mp.spawn(_prefetch_on_rank, args=(2, tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["seen"] == [0, 4, 8] and ranks[0]["cached_at_end"] == 12
    assert [r["computed"] for r in ranks] == [6, 6]


def test_every_rank_cuts_the_batches_rank_0_chose(tmp_path, monkeypatch):
    """Ranks whose own plans differ (here their deployments' batch sizes; in practice their
    saved profiles, near the threshold that leaves a scenario's batches uncapped) run rank 0's
    batches: each request once, in the same rounds as before."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    mp.spawn(_prefetch_on_rank, args=(2, tmp_path, (2, 3)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["seen"] == [0, 4, 8] and ranks[0]["cached_at_end"] == 12
    assert [r["computed"] for r in ranks] == [6, 6]


def _choose_on_rank(rank, world, tmp, case):
    """One rank of test_ranks_stop_together_where_rank_0s_choice_cannot_run: rank 0's choice
    fails to be made ("rank 0 fails") or rank 1's engine cannot run it ("rank 1 cannot run")."""
    import types

    import torch.distributed as dist

    from flexgen_helm.errors import ClusterError
    from flexgen_helm.helm.data_parallel import rank_0s_choice
    from flexgen_helm.helm.scenario_plan import BatchingChoice

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    refuses = case == "rank 1 cannot run" and rank == 1
    engine = types.SimpleNamespace(cannot_run=lambda policy: "loaded with other weights" if refuses else None)
    client = types.SimpleNamespace(handle=types.SimpleNamespace(engine=engine))

    def choose():
        if case == "rank 0 fails":
            raise ValueError("a corrupt profile")
        return BatchingChoice(max_batch=4, max_batch_share=None, policy="rank 0's block")

    try:
        rank_0s_choice(client, choose)
        outcome = "ran"
    except (ClusterError, ValueError) as e:
        outcome = f"{type(e).__name__}: {e}"
    (tmp / f"rank-{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


@pytest.mark.parametrize("case", ["rank 0 fails", "rank 1 cannot run"])
def test_ranks_stop_together_where_rank_0s_choice_cannot_run(tmp_path, monkeypatch, case):
    """Every rank stops with an error naming why, before any batch, where rank 0 cannot make
    its batching choice or a rank's engine (loaded otherwise) cannot run it: none waits on
    the others in a collective they never reach."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    mp.spawn(_choose_on_rank, args=(2, tmp_path, case), nprocs=2)
    outcomes = [(tmp_path / f"rank-{r}.txt").read_text() for r in range(2)]
    if case == "rank 0 fails":
        assert outcomes[0] == "ValueError: a corrupt profile"
        assert outcomes[1].startswith("ClusterError: rank 0 could not plan") and "a corrupt profile" in outcomes[1]
    else:
        assert all(o.startswith("ClusterError: the data-parallel ranks cannot all run") for o in outcomes)
        assert all("rank 1: loaded with other weights" in o for o in outcomes)
