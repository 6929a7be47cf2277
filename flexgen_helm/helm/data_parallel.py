"""Data parallelism for HELM runs: K engine replicas (one per process, launched by
torchrun) share the requests of each run, and the results are gathered into one HELM run.

    torchrun --nproc-per-node 2 -m flexgen_helm.helm.data_parallel <helm-run arguments>
    srun -N 2 --ntasks-per-node 1 python -m flexgen_helm.helm.data_parallel <helm-run arguments>

Under srun the ranks come from Slurm's variables (dist/rendezvous.py); either way every
rank waits at most FLEXGEN_HELM_RENDEZVOUS_TIMEOUT_S (300 s) for the others, then exits with
one line naming the rendezvous address.

Rank 0 is the real helm-run: its output path, prod_env and cache are the user's. It
decides which requests still need computing and how the batches are cut (its block, planned
from its own profile: the other ranks' may differ); every rank then plans the same batches as
a single process would (scenario_plan.py), so the results are a single process's, and the
ranks take turns: round r runs batch r*K + k on rank k. At the end of each round every rank
receives the round's results, and rank 0 puts them in its cache before the next round
starts, so a killed run loses at most the round in progress, as a single process loses its
batch in progress. The other ranks run the same helm-run in throwaway folders (and an empty
cache), so that they build the same requests from the same scenarios; they find all
results ready and their outputs are discarded.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile

import torch.distributed as dist
from helm.common.cache import create_key_value_store
from helm.common.hierarchical_logger import hlog

from flexgen_helm.dist.rendezvous import join_process_group, rendezvous_timeout_s
from flexgen_helm.errors import ClusterError, DiskFullError
from flexgen_helm.helm.batching import run_batches
from flexgen_helm.helm.runner import BatchingRunner
from flexgen_helm.helm.scenario_executor import BatchingExecutor


class DataParallelExecutor(BatchingExecutor):
    def prefetch_client(self, client, requests) -> int:
        return prefetch_data_parallel(client, requests)


def prefetch_data_parallel(client, requests) -> int:
    """`client.prefetch` shared among the ranks of the process group; returns the number of
    requests this rank computed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    unique = client.unique_requests(requests)
    # rank 0's cache decides what is left to compute; its cached answers travel too
    found = [client.cached_responses({key: raw for key, (_, raw) in unique.items()}) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    cached = found[0]
    if rank:  # rank 0 finds its cached answers in its own cache (reported as cached there)
        for key, response in cached.items():
            client.keep(key, response)
    if len(cached) == len(unique):
        return 0
    plan = client.plan(unique, set(cached), decide=functools.partial(rank_0s_choice, client))
    if rank == 0:
        client.log_plan(plan)
    computed = 0
    with create_key_value_store(client.cache.config) as store:
        for first in range(0, len(plan.batches), world):
            mine = plan.batches[first + rank] if first + rank < len(plan.batches) else []
            with client.handle.running_under(plan.policy):
                error = _disk_full_message(run_batches, client.handle, [mine] if mine else [])
            computed += len(mine)
            gathered = [None] * world  # (responses, a full disk's message) of every rank
            dist.all_gather_object(gathered, (client.new_responses(plan, mine), error))
            responses = {key: r for part, _ in gathered for key, r in part.items()}
            if rank == 0:  # what finished is kept, whatever failed
                error = _disk_full_message(client.publish, store, plan, responses) or error
            else:
                for key, response in responses.items():
                    client.keep(key, response)
            # the round ends together; a full disk on any rank (or rank 0's cache) stops them all
            errors = [next((e for _, e in gathered if e), None) or (error if rank == 0 else None)]
            dist.broadcast_object_list(errors, src=0)
            if errors[0]:
                raise DiskFullError(errors[0])
    hlog(f"flexgen data-parallel: rank {rank} computed {computed} of {plan.requests_to_run} requests")
    return computed


def rank_0s_choice(client, choose):
    """Rank 0's batching choice (`choose()` there), on every rank: each would plan the
    scenario's block from its own saved profile and loaded policy, and ranks that chose apart
    would cut different batches (a request run twice, another never). Every rank stops with
    the same error where rank 0 could not choose or a rank's engine cannot run the choice
    (it was loaded otherwise: Engine.cannot_run), before any batch, so that none waits on the
    others in a collective they never reach."""
    rank, world = dist.get_rank(), dist.get_world_size()
    made, error = [None], None
    if rank == 0:
        try:
            made = [(choose(), None)]
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, never wait for a choice
            made, error = [(None, f"{type(e).__name__}: {e}")], e
    dist.broadcast_object_list(made, src=0)
    choice, failed = made[0]
    if error is not None:
        raise error  # rank 0's own, as a single process would raise it
    if failed:
        raise ClusterError(f"rank 0 could not plan this scenario's batches: {failed}")
    # a choice with a policy of its own comes from the planner, which plans for real engines alone
    problem = client.handle.engine.cannot_run(choice.policy) if choice.policy is not None else None
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if found:
        raise ClusterError("the data-parallel ranks cannot all run the block rank 0 planned for this scenario "
                           f"(their engines were loaded otherwise: load them alike): {'; '.join(found)}")
    return choice


def _disk_full_message(step, *args) -> str | None:
    """Run `step(*args)`; the message of the DiskFullError it raised, else None."""
    try:
        step(*args)
    except DiskFullError as e:
        return str(e)
    return None


class DataParallelRunner(BatchingRunner):
    executor_class = DataParallelExecutor


def _private_folders(argv: list[str], rank: int) -> list[str]:
    """helm-run arguments for a helper rank: outputs and cache in a temporary folder,
    the user's prod_env configuration (not its cache) copied there."""
    args = list(argv)
    root = tempfile.mkdtemp(prefix=f"flexgen-dp-rank{rank}-")
    local = _value(args, ("--local-path",), "prod_env")
    private_local = os.path.join(root, "prod_env")
    if os.path.isdir(local):
        shutil.copytree(local, private_local, ignore=shutil.ignore_patterns("cache"))
    _set(args, ("--local-path",), private_local)
    _set(args, ("-o", "--output-path"), os.path.join(root, "benchmark_output"))
    return args


def _value(args, names, default):
    for i, a in enumerate(args[:-1]):
        if a in names:
            return args[i + 1]
    return default


def _set(args, names, value):
    for i, a in enumerate(args[:-1]):
        if a in names:
            args[i + 1] = value
            return
    args += [names[-1], value]


def main() -> None:
    try:
        rank, _ = join_process_group("gloo", rendezvous_timeout_s())
    except ClusterError as e:  # one line, and this rank exits: its peers time out the same way
        raise SystemExit(f"flexgen data-parallel: {e}") from None
    argv = sys.argv[1:] if rank == 0 else _private_folders(sys.argv[1:], rank)
    _set(argv, ("--runner-class-name",), f"{__name__}.DataParallelRunner")
    from helm.benchmark.run import main as helm_run

    sys.argv = ["helm-run", *argv]
    try:
        helm_run()
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
