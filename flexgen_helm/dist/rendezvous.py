"""Joining a torch.distributed process group, under torchrun or straight from Slurm's srun,
with a bounded wait and one clear error when a rank cannot reach the others.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (env://). `srun` without
torchrun sets SLURM_PROCID and SLURM_NTASKS instead: `slurm_to_torch_env` maps them, the
address being that of the step's first node (scontrol's NodeAddr; or MASTER_ADDR if set) and
the port MASTER_PORT, else one derived from the job id, so every task of a step agrees.
"""

from __future__ import annotations

import datetime
import os
import subprocess

import torch.distributed as dist

from flexgen_helm.errors import ClusterError

TIMEOUT_ENV = "FLEXGEN_HELM_RENDEZVOUS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
_PORT_BASE, _PORT_SPAN = 20000, 20000  # ports a job id maps to


def rendezvous_timeout_s(default: float = DEFAULT_TIMEOUT_S) -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ClusterError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def slurm_to_torch_env() -> bool:
    """Set torch's env:// variables from Slurm's when srun (not torchrun) started this
    process; True if it did. Nothing when RANK is already set or this is no Slurm task."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_STEP_NUM_TASKS" not in os.environ:
        return False
    env = os.environ
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1"),
                                                int(env.get("SLURM_NODEID", "0"))))
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = _first_node_address(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    env.setdefault("MASTER_PORT", str(_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % _PORT_SPAN))
    return True


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The tasks on node `node` of a step, from Slurm's compressed list ("2(x3),1": 2, 2, 2, 1)."""
    counts = []
    for part in tasks_per_node.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts[node] if node < len(counts) else counts[-1]


def _first_node_address(nodelist: str) -> str:
    """The address slurmd of the first node of `nodelist` listens on (its NodeAddr)."""
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=10, check=True).stdout.split()
        node = subprocess.run(["scontrol", "show", "node", names[0]], capture_output=True, text=True,
                              timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise ClusterError(f"cannot find the first node of {nodelist!r} with scontrol ({e}); set MASTER_ADDR") from e
    for field in node.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    raise ClusterError(f"scontrol shows no NodeAddr for {names[0]}; set MASTER_ADDR")


def join_process_group(backend: str, timeout_s: float) -> tuple[int, int]:
    """init_process_group from the environment, waiting at most `timeout_s` for the other
    ranks; (rank, world size). A rank that cannot reach the rendezvous, or a rank 0 whose
    peers never come, ends with a ClusterError naming the address and the timeout.

    `timeout_s` bounds the joining only: the group's collectives afterwards (a gather after a
    round of batches, a pipeline stage waiting for the one before) keep torch's default, since
    a batch can take far longer than a peer needs to start."""
    slurm_to_torch_env()
    if "RANK" not in os.environ:
        raise ClusterError("launch with torchrun (e.g. torchrun --nproc-per-node 2 ...) or srun "
                           "(e.g. srun -N 2 --ntasks-per-node 1 python -m ...)")
    missing = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ClusterError(f"RANK is set but not {', '.join(missing)}: launch with torchrun or srun, or set them all")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if not port.isdigit():
        raise ClusterError(f"MASTER_PORT={port!r}: expected the port number of rank 0's rendezvous")
    try:
        # rank 0 serves the store and waits for every other rank to connect to it; the others
        # connect, retrying until the timeout
        store = dist.TCPStore(host, int(port), world, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=True)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    except (RuntimeError, TimeoutError, OSError) as e:  # torch's DistStoreError is a RuntimeError
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterError(
            f"rank {rank} of {world}: the process group's rendezvous at {host}:{port} did not complete within "
            f"{timeout_s:g} s ({cause}); check that every rank was started and that rank 0's host and port are "
            f"reachable from here ({TIMEOUT_ENV} sets the wait)") from e
    return rank, world
