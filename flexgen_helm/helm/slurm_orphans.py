"""A run's Slurm job left behind by a helm-run that never ended cleanly, taken over by the next.

HELM's SlurmRunner cancels its worker jobs in a `finally` when helm-run ends. A helm-run
killed with SIGKILL (an OOM killer, a lost login node) runs no `finally`: its jobs go on,
and the same command again would submit a second job for every run still running, two
jobs computing the same missing batches at once into the same cache and run folder.
So each worker job carries a tag (sbatch's `--comment`) naming its run (working folder,
output folder, suite, run name) and what it computes (the run spec, the runner's settings
that reach the job, FLEXGEN_HELM_* variables). Before submitting a run, the manager looks
for this user's live jobs of the same run: one that computes the same is followed instead
of submitting another (the batches it finishes are the rerun's); one that computes
something else (the run spec changed) is cancelled, and waited for, before the new job is
submitted (the batches it finished stay in HELM's cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import time

from helm.common.hierarchical_logger import hlog

from flexgen_helm.errors import ClusterError

TAG = "flexgen-helm-run"
# states of a job that still runs or will (squeue -t); a COMPLETING one has ended its work
LIVE_STATES = "PENDING,RUNNING,SUSPENDED,CONFIGURING,REQUEUED,RESIZING"
CANCEL_WAIT_S = 120  # Slurm's KillWait (30 s by default) and its epilog, with room to spare
COMMAND_TIMEOUT_S = 30
# fields of HELM's SlurmRunnerSpec that change what a job computes (skip_completed_runs and
# exit_on_error act in the manager only: a rerun may add --skip-completed-runs)
_WORK_FIELDS = ("execution_spec", "output_path", "suite", "skip_instances", "cache_instances", "cache_instances_only")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def job_tag(chdir: str, runner_spec_json: str, run_spec_json: str, env: dict[str, str] | None = None) -> str:
    """The comment a run's worker job carries: `flexgen-helm-run=<run>,work=<what it computes>`
    (characters that need no quoting in an sbatch script)."""
    runner, run = json.loads(runner_spec_json), json.loads(run_spec_json)
    env = os.environ if env is None else env
    flexgen_env = json.dumps(sorted((k, v) for k, v in env.items() if k.startswith("FLEXGEN_HELM_")))
    where = _digest(os.path.realpath(chdir), str(runner["output_path"]), str(runner["suite"]), run["name"])
    work = _digest(where, json.dumps({k: runner.get(k) for k in _WORK_FIELDS}, sort_keys=True),
                   json.dumps(run, sort_keys=True), flexgen_env)
    return f"{TAG}={where},work={work}"


def _run_of(tag: str) -> str | None:
    match = re.fullmatch(rf"{TAG}=(\w+),work=\w+", tag.strip())
    return match[1] if match else None


def tag_of_worker(command: str, chdir: str) -> str:
    """The tag of the worker job HELM's `command` starts (it names the two spec files HELM
    wrote, relative to `chdir`, before submitting)."""
    argv = shlex.split(command)
    paths = {flag: argv[argv.index(flag) + 1] for flag in ("--slurm-runner-spec-path", "--run-spec-path")}
    texts = {}
    for flag, path in paths.items():
        with open(os.path.join(chdir, path)) as f:
            texts[flag] = f.read()
    return job_tag(chdir, texts["--slurm-runner-spec-path"], texts["--run-spec-path"])


def _slurm(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"`{shlex.join(argv)}` failed ({e}): slurmctld is down or unreachable") from e
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ClusterError(f"`{shlex.join(argv)}` failed ({reason}): slurmctld is down or unreachable")
    return done.stdout


def live_jobs() -> list[tuple[int, str]]:
    """(job id, comment) of this user's jobs that run or will."""
    out = _slurm("squeue", "--me", "-h", "-t", LIVE_STATES, "-o", "%i|%k")
    return [(int(i), comment) for i, _, comment in (line.partition("|") for line in out.splitlines() if line)]


def follow_or_cancel(tag: str, jobs: list[tuple[int, str]]) -> tuple[int | None, list[int]]:
    """Of `jobs` (id, comment): the one to follow for a run tagged `tag` (the oldest that computes
    the same, or None) and those of the same run to cancel (the rest)."""
    run = _run_of(tag)
    same_run = {i: comment.strip() for i, comment in jobs if _run_of(comment) == run}
    same_work = sorted(i for i, comment in same_run.items() if comment == tag)
    follow = same_work[0] if same_work else None
    return follow, sorted(i for i in same_run if i != follow)


def _job_field(job_id: int, field: str) -> str | None:
    """A field of `scontrol show job`; None once Slurm has forgotten the job."""
    try:
        out = _slurm("scontrol", "-o", "show", "job", str(job_id))
    except ClusterError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    match = re.search(rf"\b{field}=(\S+)", out)
    return match[1] if match else None


def cancel_and_wait(job_ids: list[int], timeout_s: float = CANCEL_WAIT_S) -> None:
    """scancel the jobs and wait until none of them runs any more."""
    if not job_ids:
        return
    _slurm("scancel", *map(str, job_ids))
    deadline = time.monotonic() + timeout_s
    left = list(job_ids)
    while left:
        left = [i for i in left if _job_field(i, "JobState") in LIVE_STATES.split(",") + ["COMPLETING"]]
        if not left:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"Slurm job(s) {left} still running {timeout_s:.0f} s after scancel; cancel them "
                               f"(`scancel {' '.join(map(str, left))}`) before running this suite again")
        time.sleep(1)


def take_over(tag: str, run_name: str) -> int | None:
    """Before a run's job is submitted: the id of a live job of the same run that computes the
    same (to follow instead of submitting), after cancelling the run's other live jobs."""
    follow, cancel = follow_or_cancel(tag, live_jobs())
    if cancel:
        hlog(f"flexgen: cancelling Slurm job(s) {cancel} of {run_name}, left by a helm-run that did not end, "
             f"which compute another version of it (their finished batches stay in HELM's cache)")
        cancel_and_wait(cancel)
    if follow is not None:
        hlog(f"flexgen: {run_name} is still running as Slurm job {follow} (log: {_job_field(follow, 'StdOut')}), "
             f"submitted by a helm-run that did not end: following it instead of submitting another")
    return follow
