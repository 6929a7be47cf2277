"""Data-parallel HELM: two engine replicas (torchrun, gloo) share a run's requests, and
the run they produce is the one a single process produces."""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import session_cache_env
from ports import free_port
from test_helm_e2e import helm_run, run_dirs

pytest.importorskip("helm")
ENTRIES = ["lambada:model=flexgen/smollm2-135m", "synthetic_reasoning:mode=pattern_match,model=flexgen/smollm2-135m"]


def _completions(run_dir):
    state = json.loads((run_dir / "scenario_state.json").read_text())
    return [rs["result"]["completions"][0]["text"] for rs in state["request_states"]]


def test_two_replicas_give_the_single_process_run(tmp_path, fake_helm_suite):
    """The single process's run: the session's (conftest.fake_helm_suite: BatchingRunner, the
    same three instances of each scenario). The replicas' fake engines take blocks of 2
    (FLEXGEN_FAKE_BLOCK): each scenario's three requests are two batches, one a rank, so
    that rank 1's results reach the run too."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), "-m", "flexgen_helm.helm.data_parallel"]
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


def _prefetch_on_rank(rank, world, cases):
    """One rank of the prefetch tests: each of `cases` (folder, batch_sizes) in turn, on one
    process group (whose collectives a case must leave in step for the next)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{cases[0][0]}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # ranks out of step fail, never hang
    for tmp, batch_sizes in cases:
        _prefetch_case(rank, tmp, batch_sizes)
    dist.destroy_process_group()


def _prefetch_case(rank, tmp, batch_sizes):
    """batch_sizes: each rank's deployment's max_batch_size (what its own plan would cut by)."""
    os.environ["FLEXGEN_HELM_ENGINE_FACTORY"] = "helm_fake_engine:load"
    from helm.common.cache import SqliteCacheConfig
    from helm.common.key_value_store import SqliteKeyValueStore
    from helm.common.request import Request

    from flexgen_helm.helm import engines
    from flexgen_helm.helm.client import FlexGenClient
    from flexgen_helm.helm.data_parallel import prefetch_data_parallel

    engines.clear()  # the case's client on an engine of its own, as a fresh process's
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


def spawned_env(tmp_path_factory) -> dict[str, str]:
    """What spawned ranks need from the environment: tests/ on their path (the fake engine),
    the session's cache (module fixtures run before the autouse conftest._isolated_cache)."""
    return {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
            **session_cache_env(tmp_path_factory)}


@pytest.fixture(scope="module")
def prefetched(tmp_path_factory):
    """Both prefetch tests' cases in one pair of spawned ranks (each rank's start imports
    torch, HELM and the plugin: seconds): case -> each rank's record."""
    import torch.multiprocessing as mp

    cases = {"same plans": (tmp_path_factory.mktemp("same-plans"), (2, 2)),
             "plans apart": (tmp_path_factory.mktemp("plans-apart"), (2, 3))}
    with pytest.MonkeyPatch.context() as env:
        for name, value in spawned_env(tmp_path_factory).items():
            env.setenv(name, value)
        mp.spawn(_prefetch_on_rank, args=(2, list(cases.values())), nprocs=2)
    return {case: [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(2)]
            for case, (tmp, _) in cases.items()}


def test_each_round_of_batches_is_in_rank_0s_cache_before_the_next_starts(prefetched):
    """12 requests in 6 batches of 2, two ranks: three rounds, and each round's 4 results
    (both ranks') are in rank 0's cache before its next batch starts, as a single process
    caches each batch as it ends: a killed run loses at most the round in progress."""
    ranks = prefetched["same plans"]
    assert ranks[0]["seen"] == [0, 4, 8] and ranks[0]["cached_at_end"] == 12
    assert [r["computed"] for r in ranks] == [6, 6]


def test_every_rank_cuts_the_batches_rank_0_chose(prefetched):
    """Ranks whose own plans differ (here their deployments' batch sizes; in practice their
    saved profiles, near the threshold that leaves a scenario's batches uncapped) run rank 0's
    batches: each request once, in the same rounds as before."""
    ranks = prefetched["plans apart"]
    assert ranks[0]["seen"] == [0, 4, 8] and ranks[0]["cached_at_end"] == 12
    assert [r["computed"] for r in ranks] == [6, 6]


CHOICE_CASES = ("rank 0 fails", "rank 1 cannot run")


def _choose_on_rank(rank, world, tmp, cases):
    """One rank of test_ranks_stop_together_where_rank_0s_choice_cannot_run: each of `cases`
    in turn, on one process group (whose collectives a case must leave in step for the next);
    each case's outcome in tmp/<case>/rank-R.txt."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    for case in cases:
        (tmp / case).mkdir(exist_ok=True)
        _choose_case(rank, tmp / case, case)
    dist.destroy_process_group()


def _choose_case(rank, tmp, case):
    """Rank 0's choice fails to be made ("rank 0 fails") or rank 1's engine cannot run it
    ("rank 1 cannot run")."""
    import types

    from flexgen_helm.errors import ClusterError
    from flexgen_helm.helm.data_parallel import rank_0s_choice
    from flexgen_helm.helm.scenario_plan import BatchingChoice

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


@pytest.fixture(scope="module")
def choices(tmp_path_factory):
    """Both cases of test_ranks_stop_together_where_rank_0s_choice_cannot_run in one pair of
    spawned ranks: case -> each rank's outcome."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("choices")
    with pytest.MonkeyPatch.context() as env:
        for name, value in spawned_env(tmp_path_factory).items():
            env.setenv(name, value)
        mp.spawn(_choose_on_rank, args=(2, tmp, CHOICE_CASES), nprocs=2)
    return {case: [(tmp / case / f"rank-{r}.txt").read_text() for r in range(2)] for case in CHOICE_CASES}


@pytest.mark.parametrize("case", CHOICE_CASES)
def test_ranks_stop_together_where_rank_0s_choice_cannot_run(choices, case):
    """Every rank stops with an error naming why, before any batch, where rank 0 cannot make
    its batching choice or a rank's engine (loaded otherwise) cannot run it: none waits on
    the others in a collective they never reach."""
    outcomes = choices[case]
    if case == "rank 0 fails":
        assert outcomes[0] == "ValueError: a corrupt profile"
        assert outcomes[1].startswith("ClusterError: rank 0 could not plan") and "a corrupt profile" in outcomes[1]
    else:
        assert all(o.startswith("ClusterError: the data-parallel ranks cannot all run") for o in outcomes)
        assert all("rank 1: loaded with other weights" in o for o in outcomes)
