"""helm-run (HELM's SlurmRunner) killed with SIGKILL while its job runs, and the same command
started again while that job still runs: how many jobs run the run, and how many requests
are computed. The tests' tiny Llama on 6 short local passages, float32, batches of 2; the job
is held before its second batch (tests/held_engine.py) until the rerun's job has ended, or
until the rerun follows it (then released).

    REPO=/work/main|/work/wt-50 python runs/cluster/kill_manager_tiny/rerun_while_orphan_runs.py OUT_DIR

REPO: whose flexgen_helm the helm-runs and jobs import (PYTHONPATH); the helpers are this
checkout's tests/. Prints the counts.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(HERE / "tests"))
import test_cluster as tc  # noqa: E402
from conftest import save_tiny  # noqa: E402
from test_helm_e2e import run_dirs  # noqa: E402

from flexgen_helm.tools.slurm_faults import cached_completions  # noqa: E402

repo, tmp = os.environ["REPO"], Path(sys.argv[1])
tmp.mkdir(parents=True)
hold = tmp / "hold"
kwargs = tc._tiny_lambada(tmp, save_tiny("llama", tmp / "tiny"), hold)
kwargs["env"]["PYTHONPATH"] = os.pathsep.join([repo, str(HERE / "tests")])
cache = tmp / "slurm" / "prod_env" / "cache" / "flexgen.sqlite"
manager = tc._start_slurm_helm_run(tmp, tmp / "killed.log", **kwargs)
tc._wait_for("held job", lambda: (hold / "held").exists() or manager.poll() is not None, 300)
job = tc._submitted_job(tmp)
manager.kill()
manager.wait()
print(f"helm-run (pid {manager.pid}) killed with SIGKILL; job {job}: {cached_completions(cache)} requests cached")
time.sleep(3)
print("jobs after the kill:", subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True,
                                            text=True).stdout.strip().replace("\n", "; "))
rerun_kwargs = dict(kwargs, env={k: v for k, v in kwargs["env"].items() if k != "FLEXGEN_TEST_HOLD"})
rerun = tc._start_slurm_helm_run(tmp, tmp / "rerun.log", **rerun_kwargs)
seen = set()
while rerun.poll() is None:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True).stdout
    seen |= {line for line in out.splitlines() if "RUNNING" in line}
    if "following it" in (tmp / "rerun.log").read_text():
        (hold / "release").touch()
    time.sleep(0.5)
print("rerun's helm-run exit status:", rerun.returncode)
(hold / "release").touch()  # the first job, if the rerun did not follow it
tc._wait_for("the first job to end", lambda: not subprocess.run(["squeue", "-h", "-j", str(job)], capture_output=True,
                                                                 text=True).stdout.strip(), 120)
print("jobs seen running during the rerun:", "; ".join(sorted(seen)))
manager_logs = (tmp / "killed.log").read_text() + (tmp / "rerun.log").read_text()
# HELM's manager logs a followed job as "submitted" too: count the distinct ids
print("jobs of the run (ids in the helm-runs' logs):",
      sorted(set(re.findall(r"Worker Slurm job submitted .* Slurm job ID: (\d+)", manager_logs))))
print("the rerun:", "; ".join(line.split("INFO")[-1].strip().split(" (log:")[0]
                              for line in (tmp / "rerun.log").read_text().splitlines() if "flexgen:" in line) or "-")
logs = tc._job_logs(tmp)
print("jobs' plans:", "; ".join(line.split("INFO")[-1].strip() for line in logs.splitlines()
                                if "flexgen: running" in line))
print("jobs' cache counts:", "; ".join(line.split("INFO")[-1].strip() for line in logs.splitlines()
                                       if "flexgen.sqlite:" in line))
reference = tc._reference_run(tmp, kwargs)
print("completions equal to one process:", tc._completions(run_dirs(tmp / "slurm")["lambada"]) == reference)
