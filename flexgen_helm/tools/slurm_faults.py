"""Faults injected into a HELM suite on Slurm, and what the suite's cache holds meanwhile.

    python -m flexgen_helm.tools.slurm_faults cached CACHE.sqlite   # completions in HELM's cache
    python -m flexgen_helm.tools.slurm_faults processes JOB_ID      # the job's processes here
    python -m flexgen_helm.tools.slurm_faults kill9 JOB_ID          # SIGKILL them all at once

`kill9` does to a job what an OOM killer or a crashed node does: every process of the job
on this host (found by SLURM_JOB_ID in its environment: the batch shell and the Python
worker) gets SIGKILL at once, so nothing of it can clean up. slurmstepd, Slurm's own agent,
is spared, as on a node that survives: it reports the job's end. Used by
cluster/slurm_resume.sh and tests/test_cluster.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
from pathlib import Path

from flexgen_helm.errors import ClusterError

SLURM_AGENT = "slurmstepd"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def job_processes(job_id: int | str) -> list[int]:
    """The pids of this host's processes of Slurm job `job_id`, Slurm's agent excepted."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or _read(proc / "comm").strip() == SLURM_AGENT.encode():
            continue
        if marker in _read(proc / "environ").split(b"\0"):
            pids.append(int(proc.name))
    return sorted(pids)


def command_line(pid: int) -> str:
    return _read(Path(f"/proc/{pid}/cmdline")).replace(b"\0", b" ").decode(errors="replace").strip()


def kill9_job(job_id: int | str) -> dict[int, str]:
    """SIGKILL every process of job `job_id` on this host at once; {pid: its command line}."""
    pids = job_processes(job_id)
    if not pids:
        raise ClusterError(f"Slurm job {job_id} has no process on this host to kill (is it running here?)")
    killed = {pid: command_line(pid) for pid in pids}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            killed.pop(pid)  # it ended on its own meanwhile
    return killed


def cached_completions(cache_path: str | Path) -> int:
    """Completions in a HELM SQLite cache (generation requests: its tokenizer's calls are cached
    there too); 0 while the cache does not exist yet or is being created."""
    path = Path(cache_path)
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as db:
            return db.execute("select count(*) from unnamed where key like '%\"max_tokens\"%'").fetchone()[0]
    except sqlite3.Error:  # no table yet
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("cached").add_argument("cache")
    sub.add_parser("processes").add_argument("job")
    sub.add_parser("kill9").add_argument("job")
    args = parser.parse_args(argv)
    if args.what == "cached":
        print(cached_completions(args.cache))
    elif args.what == "processes":
        for pid in job_processes(args.job):  # one a line, none: no line (the script counts lines)
            print(pid)
    else:
        try:
            killed = kill9_job(args.job)
        except ClusterError as e:
            print(f"slurm_faults: {e}", file=sys.stderr)
            return 1
        print("; ".join(f"{pid} {cmd[:100]}" for pid, cmd in killed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
