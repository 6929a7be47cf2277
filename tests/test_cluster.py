"""Clusters: HELM's SlurmRunner with flexgen deployments (end to end where Slurm runs),
Slurm absent or down in one line, and a rank that cannot reach its rendezvous."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("helm")

from ports import free_port

from flexgen_helm.dist import rendezvous
from flexgen_helm.errors import ClusterError
from flexgen_helm.helm import slurm, slurm_orphans

REPO = Path(__file__).resolve().parents[1]


# ----- Slurm absent or down ---------------------------------------------------------------------


def _fake_bin(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_slurm_not_installed_is_one_line_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    problem = slurm.slurm_problem()
    assert "`sbatch` / `sinfo` not found" in problem and "local_slurm.sh start" in problem and "\n" not in problem


def test_slurm_down_is_one_line_with_sinfos_reason(tmp_path, monkeypatch):
    _fake_bin(tmp_path, "sbatch", "exit 0\n")
    _fake_bin(tmp_path, "sinfo", "echo 'sinfo: error: Unable to contact slurm controller (connect failure)' >&2\n"
                                 "exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    problem = slurm.slurm_problem()
    assert problem.startswith("`sinfo` failed (sinfo: error: Unable to contact slurm controller")
    assert "local_slurm.sh start" in problem and "\n" not in problem


def test_the_worker_command_is_helms_with_the_plugin_loading_worker():
    helm_command = (f"{sys.executable} -m helm.benchmark.slurm_runner --slurm-runner-spec-path 'a b.json' "
                    "--run-spec-path r")
    assert slurm.worker_command(helm_command) == (
        f"{sys.executable} -m flexgen_helm.helm.slurm --slurm-runner-spec-path 'a b.json' --run-spec-path r")
    with pytest.raises(ClusterError, match="unexpected command"):
        slurm.worker_command("python -m something.else")


# ----- a helm-run killed outright: its jobs found again by the next -----------------------------


def _specs(max_instances=6, skip_completed_runs=False) -> tuple[str, str]:
    runner = {"execution_spec": {"local_path": "prod_env", "parallelism": 4}, "output_path": "benchmark_output",
              "suite": "s", "skip_instances": False, "cache_instances": False, "cache_instances_only": False,
              "skip_completed_runs": skip_completed_runs, "exit_on_error": True}
    run = {"name": "lambada:model=flexgen_tiny", "adapter_spec": {"max_eval_instances": max_instances}}
    return json.dumps(runner), json.dumps(run)


def test_a_rerun_follows_its_runs_live_job_and_cancels_other_versions_of_it(tmp_path):
    tag = slurm_orphans.job_tag(str(tmp_path), *_specs(), env={})
    assert re.fullmatch(r"flexgen-helm-run=\w+,work=\w+", tag)  # no quoting needed in an sbatch script
    # --skip-completed-runs acts in the manager: the same job's work
    assert slurm_orphans.job_tag(str(tmp_path), *_specs(skip_completed_runs=True), env={}) == tag
    other_version = slurm_orphans.job_tag(str(tmp_path), *_specs(max_instances=8), env={})
    assert other_version.split(",")[0] == tag.split(",")[0] and other_version != tag
    dtype = slurm_orphans.job_tag(str(tmp_path), *_specs(), env={"FLEXGEN_HELM_DTYPE": "float32"})
    other_run = slurm_orphans.job_tag(str(tmp_path / "elsewhere"), *_specs(), env={})
    jobs = [(5, other_version), (9, tag), (7, tag + "\n"), (3, other_run), (4, "(null)"), (6, dtype)]
    assert slurm_orphans.follow_or_cancel(tag, jobs) == (7, [5, 6, 9])  # the oldest same job; the run's others
    assert slurm_orphans.follow_or_cancel(tag, [(3, other_run), (4, "(null)")]) == (None, [])


def test_take_over_cancels_the_runs_other_jobs_waits_for_them_and_follows_the_same(tmp_path, monkeypatch):
    tag = slurm_orphans.job_tag(str(tmp_path), *_specs(), env={})
    other_version = slurm_orphans.job_tag(str(tmp_path), *_specs(max_instances=8), env={})
    calls = tmp_path / "calls"
    _fake_bin(tmp_path, "squeue", f"echo \"squeue $*\" >> {calls}\nprintf '5|{other_version}\\n7|{tag}\\n'\n")
    _fake_bin(tmp_path, "scancel", f"echo \"scancel $*\" >> {calls}\n")
    _fake_bin(tmp_path, "scontrol", "echo \"JobId=$4 JobState=CANCELLED Reason=None StdOut=/x/$4.log\"\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm_orphans.take_over(tag, "lambada:model=flexgen_tiny") == 7
    squeue, scancel = calls.read_text().splitlines()
    assert squeue.startswith("squeue --me -h -t PENDING,RUNNING") and scancel == "scancel 5"
    _fake_bin(tmp_path, "squeue", "echo 'squeue: error: Unable to contact slurm controller' >&2; exit 1\n")
    with pytest.raises(ClusterError, match="`squeue --me .*` failed \\(squeue: error: Unable to contact"):
        slurm_orphans.take_over(tag, "lambada:model=flexgen_tiny")


def test_each_job_is_submitted_tagged_and_a_live_one_is_followed_not_submitted_again(tmp_path, monkeypatch):
    import helm.benchmark.slurm_runner as helm_slurm
    from helm.benchmark.runner_config_registry import RUNNER_CONFIG

    runner_json, run_json = _specs()
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "runner.json").write_text(runner_json)
    (tmp_path / "specs" / "run.json").write_text(run_json)
    tag = slurm_orphans.job_tag(str(tmp_path), runner_json, run_json)
    bin_dir, live = tmp_path / "bin", tmp_path / "live"
    bin_dir.mkdir()
    live.write_text("")
    _fake_bin(bin_dir, "sinfo", "echo idle\n")
    _fake_bin(bin_dir, "squeue", f"cat {live}\n")
    _fake_bin(bin_dir, "sbatch", f"cat > {tmp_path}/script.$$\necho 'Submitted batch job 12'\n")
    _fake_bin(bin_dir, "scontrol", "echo \"JobId=$4 JobState=RUNNING StdOut=/x.log\"\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(RUNNER_CONFIG, "slurm_args", {"partition": "local"})
    monkeypatch.chdir(tmp_path)
    slurm.use_for_helm_slurm_runner()
    command = f"{sys.executable} -m helm.benchmark.slurm_runner --slurm-runner-spec-path specs/runner.json " \
              "--run-spec-path specs/run.json"
    args = {"partition": "local", "job_name": "'lambada:model=flexgen_tiny'", "chdir": str(tmp_path)}
    assert helm_slurm.submit_slurm_job(command, args) == 12
    (script,) = [p.read_text() for p in tmp_path.glob("script.*")]
    assert re.search(rf"#SBATCH --comment\s+{tag}\n", script) and "-m flexgen_helm.helm.slurm " in script
    live.write_text(f"12|{tag}\n")  # job 12 still runs, its helm-run killed: the same command again
    assert helm_slurm.submit_slurm_job(command, args) == 12
    assert len(list(tmp_path.glob("script.*"))) == 1  # followed, not submitted
    monkeypatch.setattr(RUNNER_CONFIG, "slurm_args", {"partition": "local", "comment": "mine"})
    with pytest.raises(ClusterError, match="slurm_args sets `comment`, which flexgen-helm sets itself"):
        helm_slurm.submit_slurm_job(command, args)


def test_kill9_kills_every_process_of_a_job_and_names_a_job_without_any(tmp_path, capsys):
    from flexgen_helm.tools.slurm_faults import cached_completions, job_processes, kill9_job, main

    job_id = f"test{os.getpid()}"
    procs = [subprocess.Popen(["sleep", "60"], env=dict(os.environ, SLURM_JOB_ID=job_id)) for _ in range(2)]
    assert job_processes(job_id) == sorted(p.pid for p in procs)
    assert set(kill9_job(job_id)) == {p.pid for p in procs}
    assert [p.wait(timeout=10) for p in procs] == [-9, -9]
    capsys.readouterr()
    assert main(["processes", job_id]) == 0 and capsys.readouterr().out == ""  # scripts count its lines
    with pytest.raises(ClusterError, match=f"Slurm job {job_id} has no process on this host"):
        kill9_job(job_id)
    assert cached_completions(tmp_path / "none.sqlite") == 0


# ----- rendezvous --------------------------------------------------------------------------------


def _rank_env(monkeypatch, rank: int, port: int) -> None:
    for name, value in dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
        monkeypatch.setenv(name, str(value))


def test_a_rank_that_cannot_reach_the_rendezvous_exits_naming_address_and_timeout(monkeypatch):
    from flexgen_helm.helm import data_parallel

    port = free_port()  # nobody listens there
    _rank_env(monkeypatch, 1, port)
    monkeypatch.setenv(rendezvous.TIMEOUT_ENV, "1")
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        data_parallel.main()
    message = str(exit_info.value.code)
    assert message.startswith(f"flexgen data-parallel: rank 1 of 2: the process group's rendezvous at 127.0.0.1:{port} "
                              "did not complete within 1 s")
    assert time.monotonic() - started < 30


def test_rank_0_whose_peer_never_comes_gives_up_after_the_timeout(monkeypatch):
    port = free_port()
    _rank_env(monkeypatch, 0, port)
    with pytest.raises(ClusterError, match=f"rank 0 of 2: .* at 127.0.0.1:{port} did not complete within 1 s"):
        rendezvous.join_process_group("gloo", 1.0)


def _pythonpath_env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                **{k: str(v) for k, v in extra.items()})


def test_a_pipeline_rank_that_cannot_reach_the_rendezvous_exits_leaving_no_process(tmp_path):
    port = free_port()  # nobody listens there
    env = _pythonpath_env(RANK=1, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                          **{rendezvous.TIMEOUT_ENV: 1})
    run = subprocess.Popen([sys.executable, "-m", "flexgen_helm", "generate", "--pipeline", "--prompt", "hi",
                            "--offload-dir", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2
    assert (f"flexgen-helm: error: rank 1 of 2: the process group's rendezvous at 127.0.0.1:{port} did not "
            "complete within 1 s") in err
    with pytest.raises(ProcessLookupError):  # nothing of its session is left behind
        os.killpg(run.pid, 0)


_RANK_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from flexgen_helm.dist.rendezvous import join_process_group
ready, go = sys.argv[1:]
open(ready, "w").close()
while not os.path.exists(go):  # both ranks start joining together, whatever their import times
    time.sleep(0.05)
join_process_group("gloo", 2.0)
if dist.get_rank() == 1:
    time.sleep(4)  # a batch longer than the rendezvous timeout
t = torch.ones(1)
dist.all_reduce(t)
print(int(t.item()))
dist.destroy_process_group()
"""


def test_a_collective_may_wait_longer_than_the_rendezvous_timeout(tmp_path):
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(tmp_path / f"ready{r}"), str(tmp_path / "go")],
                              env=_pythonpath_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-1500:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["2", "2"]


def test_a_rank_without_the_rendezvous_address_is_told_which_variable(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ClusterError, match="RANK is set but not MASTER_ADDR"):
        rendezvous.join_process_group("gloo", 1.0)


def test_a_bad_timeout_is_named(monkeypatch):
    monkeypatch.setenv(rendezvous.TIMEOUT_ENV, "soon")
    with pytest.raises(ClusterError, match="FLEXGEN_HELM_RENDEZVOUS_TIMEOUT_S='soon'"):
        rendezvous.rendezvous_timeout_s()


def test_srun_tasks_get_torchs_variables(monkeypatch):
    for name, value in dict(SLURM_PROCID=3, SLURM_STEP_NUM_TASKS=4, SLURM_LOCALID=1, SLURM_NODEID=1,
                            SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_JOB_ID=123, MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, str(value))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        # set, then removed: monkeypatch then removes what slurm_to_torch_env sets, after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert rendezvous.slurm_to_torch_env()
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")}
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "20123"}
    assert rendezvous.tasks_on_node("2(x3),1", 3) == 1


# ----- HELM's SlurmRunner, end to end on a running Slurm ----------------------------------------


def _completions(run_dir: Path) -> list:
    state = json.loads((run_dir / "scenario_state.json").read_text())
    return [[(c["text"], [t["logprob"] for t in c["tokens"]]) for c in rs["result"]["completions"]]
            for rs in state["request_states"]]


@pytest.mark.skipif(slurm.slurm_problem() is not None, reason=f"no Slurm here: {slurm.slurm_problem()}")
def test_helms_slurm_runner_runs_flexgen_jobs_as_one_process_would(tmp_path):
    from test_helm_e2e import helm_run, run_dirs

    entries = ["synthetic_reasoning:mode=pattern_match,model=flexgen/smollm2-135m"]  # one job: CI time
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "slurm" / "prod_env").mkdir(parents=True)
    shutil.copy(REPO / "cluster" / "runner_config.yaml", tmp_path / "slurm" / "prod_env")
    # the fake engine keeps this about the plumbing; runs/cluster/ holds the real model's suite
    with ThreadPoolExecutor(2) as both:  # the reference process runs while the job waits in Slurm's queue
        through_slurm = both.submit(helm_run, tmp_path / "slurm", entries, "--runner-class-name",
                                    "helm.benchmark.slurm_runner.SlurmRunner", fake=True, env=env,
                                    cwd=tmp_path / "slurm")
        one_process = both.submit(helm_run, tmp_path / "single", entries, "--runner-class-name",
                                  "flexgen_helm.helm.runner.BatchingRunner", fake=True, env=env)
        assert "Worker Slurm job submitted" in through_slurm.result()
        one_process.result()
    jobs, single = run_dirs(tmp_path / "slurm"), run_dirs(tmp_path / "single")
    assert set(jobs) == set(single) == {"synthetic_reasoning"}
    for name in jobs:
        assert _completions(jobs[name]) == _completions(single[name])
        assert (jobs[name] / "flexgen_padding.json").exists()  # the BatchingRunner ran inside the job
    job_logs = list((tmp_path / "slurm" / "slurm").glob("*/logs/*.log"))
    assert len(job_logs) == 1


@pytest.mark.skipif(slurm.slurm_problem() is not None, reason=f"no Slurm here: {slurm.slurm_problem()}")
def test_a_pipeline_launched_by_srun_over_two_nodes_gives_the_single_process_tokens(tiny_llama, tmp_path):
    from test_pipeline import ARGS, PROMPTS, completion_tokens, generate_in_this_process

    generate_in_this_process(tiny_llama, tmp_path / "single.json", tmp_path)
    out = tmp_path / "srun.json"
    # the stages' process group from Slurm's variables (dist/rendezvous.py), one stage per node
    run = subprocess.run(["srun", "-N", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1", "-t", "5",
                          sys.executable, "-m", "flexgen_helm", "generate", "--pipeline", "--model", str(tiny_llama),
                          "--prompt", *PROMPTS, *ARGS, "--offload-dir", str(tmp_path / "offload"), "--json", str(out)],
                         capture_output=True, text=True, timeout=300, env=_pythonpath_env(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert completion_tokens(out) == completion_tokens(tmp_path / "single.json")


# ----- kill -9 of a job, or of helm-run itself, and the same command again ----------------------

# short passages (the tiny model's context is 64 byte tokens), alike in length: 3 batches of 2
_PASSAGES = ["the cat sat on the warm mat", "a dog ran along the old road", "she read the long red book",
             "we sailed over the calm sea", "he sang a song for the king", "they built a house of stone"]
_TINY_ENTRY = "lambada:model=flexgen/tiny"


def _tiny_lambada(tmp_path: Path, tiny_llama: Path, hold: Path | None = None) -> dict:
    """helm_run's keyword arguments for lambada on the tiny Llama (local data, float32, batches of
    2) in tmp_path/slurm and tmp_path/single; `hold`: the held engine's folder (held_engine.py)."""
    from flexgen_helm.tools.helm_deployment import write_deployment

    data = tmp_path / "data"
    (data / "lambada").mkdir(parents=True, exist_ok=True)
    (data / "lambada" / "lambada_openai_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                                         for t in _PASSAGES))
    for side in ("slurm", "single"):
        if not (tmp_path / side / "prod_env" / "model_deployments.yaml").exists():
            write_deployment("tiny", str(tiny_llama), str(tmp_path / side / "prod_env"),
                             {"gpu_batch_size": 2, "num_gpu_batches": 1})
    shutil.copy(REPO / "cluster" / "runner_config.yaml", tmp_path / "slurm" / "prod_env")
    extra = dict(FLEXGEN_HELM_DATA=data, FLEXGEN_HELM_DTYPE="float32", FLEXGEN_HELM_CACHE=tmp_path / "stores",
                 FLEXGEN_HELM_OFFLOAD_DIR=tmp_path / "offload")
    if hold is not None:
        hold.mkdir(exist_ok=True)
        extra["FLEXGEN_TEST_HOLD"] = hold
    return dict(engine_factory="held_engine:load", max_instances=len(_PASSAGES), env=_pythonpath_env(**extra))


_SLURM_RUNNER = ("--runner-class-name", "helm.benchmark.slurm_runner.SlurmRunner")


def _start_slurm_helm_run(tmp_path: Path, log: Path, **kwargs) -> subprocess.Popen:
    from test_helm_e2e import helm_run_args

    cmd, env = helm_run_args(tmp_path / "slurm", [_TINY_ENTRY], *_SLURM_RUNNER, **kwargs)
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path / "slurm")


def _wait_for(what: str, done, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def _submitted_job(tmp_path: Path) -> int:
    """The id of the one job HELM's SlurmRunner recorded (slurm/<time>/worker_slurm_jobs.json)."""
    recorded = [json.loads(p.read_text()) for p in (tmp_path / "slurm" / "slurm").glob("*/worker_slurm_jobs.json")]
    (job,) = [info["id"] for jobs in recorded for info in jobs.values()]
    return job


def _job_logs(tmp_path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "slurm" / "slurm").glob("*/logs/*.log")))


def _reference_run(tmp_path: Path, kwargs: dict) -> list:
    from test_helm_e2e import helm_run, run_dirs

    kwargs = dict(kwargs, env={k: v for k, v in kwargs["env"].items() if k != "FLEXGEN_TEST_HOLD"})
    helm_run(tmp_path / "single", [_TINY_ENTRY], "--runner-class-name", "flexgen_helm.helm.runner.BatchingRunner",
             **kwargs)
    return _completions(run_dirs(tmp_path / "single")["lambada"])


@pytest.mark.skipif(slurm.slurm_problem() is not None, reason=f"no Slurm here: {slurm.slurm_problem()}")
def test_a_job_killed_with_sigkill_and_resubmitted_computes_only_what_is_missing(tiny_llama, tmp_path):
    from test_helm_e2e import helm_run, run_dirs

    from flexgen_helm.tools.slurm_faults import cached_completions, job_processes, kill9_job

    hold = tmp_path / "hold"
    kwargs = _tiny_lambada(tmp_path, tiny_llama, hold)
    cache = tmp_path / "slurm" / "prod_env" / "cache" / "flexgen.sqlite"
    with ThreadPoolExecutor(1) as pool:  # the reference process runs while the job is in Slurm
        reference = pool.submit(_reference_run, tmp_path, kwargs)
        manager = _start_slurm_helm_run(tmp_path, tmp_path / "killed.log", **kwargs)
        _wait_for("job held in its second batch", lambda: (hold / "held").exists() or manager.poll() is not None)
        job = _submitted_job(tmp_path)
        cached_at_kill = cached_completions(cache)
        assert cached_at_kill == 2  # the first batch; the job waits before its second
        kill9_job(job)  # every process of the job at once: nothing of it can clean up
        assert manager.wait(timeout=120) != 0  # HELM's SlurmRunner reports the failed run
        assert "Failed runs" in (tmp_path / "killed.log").read_text()
        assert job_processes(job) == []
        expected = reference.result()
    assert cached_completions(cache) == cached_at_kill

    kwargs["env"].pop("FLEXGEN_TEST_HOLD")
    helm_run(tmp_path / "slurm", [_TINY_ENTRY], *_SLURM_RUNNER, cwd=tmp_path / "slurm", **kwargs)
    missing = len(_PASSAGES) - cached_at_kill
    logs = _job_logs(tmp_path)
    assert (f"running {missing} requests in 2 batches of up to 2 ({cached_at_kill} of {len(_PASSAGES)} cached)"
            in logs), logs[-3000:]
    assert re.search(rf"flexgen\.sqlite: \d+ queries, {missing} computes", logs), logs[-3000:]
    assert _completions(run_dirs(tmp_path / "slurm")["lambada"]) == expected


@pytest.mark.skipif(slurm.slurm_problem() is not None, reason=f"no Slurm here: {slurm.slurm_problem()}")
def test_helm_run_killed_with_sigkill_then_rerun_follows_its_job_not_a_second(tiny_llama, tmp_path):
    from test_helm_e2e import run_dirs

    hold = tmp_path / "hold"
    kwargs = _tiny_lambada(tmp_path, tiny_llama, hold)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_reference_run, tmp_path, kwargs)
        manager = _start_slurm_helm_run(tmp_path, tmp_path / "killed.log", **kwargs)
        _wait_for("job held in its second batch", lambda: (hold / "held").exists() or manager.poll() is not None)
        job = _submitted_job(tmp_path)
        manager.kill()  # SIGKILL: HELM's `finally` that cancels its jobs does not run
        manager.wait()
        assert slurm_orphans.live_jobs() and job in dict(slurm_orphans.live_jobs())  # the job is left running
        rerun = _start_slurm_helm_run(tmp_path, tmp_path / "rerun.log", **kwargs)
        _wait_for("the rerun to follow the job", lambda: "following it" in (tmp_path / "rerun.log").read_text()
                  or rerun.poll() is not None)
        (hold / "release").touch()
        assert rerun.wait(timeout=180) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
        expected = reference.result()
    rerun_log = (tmp_path / "rerun.log").read_text()
    assert f"still running as Slurm job {job}" in rerun_log
    # HELM's manager logs the followed job as "submitted": no other job
    assert set(re.findall(r"Worker Slurm job submitted .* Slurm job ID: (\d+)", rerun_log)) == {str(job)}
    logs = _job_logs(tmp_path)  # one job ran, once: the rerun submitted none
    assert logs.count("flexgen: running") == 1 and f"running {len(_PASSAGES)} requests" in logs
    assert _completions(run_dirs(tmp_path / "slurm")["lambada"]) == expected
