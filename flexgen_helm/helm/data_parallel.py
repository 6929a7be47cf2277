"""Data parallelism for HELM runs: K engine replicas (one per process, launched by
torchrun) share the requests of each run, and the results are gathered into one HELM run.

    torchrun --nproc-per-node 2 -m flexgen_helm.helm.data_parallel <helm-run arguments>

Rank 0 is the real helm-run: its output path, prod_env and cache are the user's. It
decides which requests still need computing, each rank computes its share, and every
rank receives every result. The other ranks run the same helm-run in throwaway folders
(and an empty cache), so that they build the same requests from the same scenarios;
they find all results ready and their outputs are discarded.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch.distributed as dist
from helm.common.hierarchical_logger import hlog

from flexgen_helm.helm.runner import BatchingRunner
from flexgen_helm.helm.scenario_executor import BatchingExecutor


class DataParallelExecutor(BatchingExecutor):
    def prefetch_client(self, client, requests) -> int:
        rank, world = dist.get_rank(), dist.get_world_size()
        by_key = {client.cache_key(r): r for r in requests if not r.embedding}
        # rank 0's cache decides what is left to compute; its cached answers travel too
        plan = [client.split_cached(list(by_key.values())) if rank == 0 else None]
        dist.broadcast_object_list(plan, src=0)
        todo_keys, cached = plan[0]
        mine = [by_key[k] for k in todo_keys[rank::world] if k in by_key]
        computed = client.compute_now(mine)
        gathered = [None] * world
        dist.all_gather_object(gathered, computed)
        # rank 0 finds its cached answers in its own cache (reported as cached there)
        for part in [*([cached] if rank else []), *gathered]:
            for key, response in part.items():
                client.keep(key, response)
        hlog(f"flexgen data-parallel: rank {rank} computed {len(mine)} of {len(todo_keys)} requests")
        return len(mine)


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
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. "
                         "torchrun --nproc-per-node 2 -m flexgen_helm.helm.data_parallel ...")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
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
