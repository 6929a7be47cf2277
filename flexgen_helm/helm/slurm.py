"""HELM's SlurmRunner with flexgen deployments: one Slurm job per run spec.

    helm-run --runner-class-name helm.benchmark.slurm_runner.SlurmRunner -c ... --suite S

HELM's manager process (helm-run) loads the plugins, but each worker job it submits runs
`python -m helm.benchmark.slurm_runner`, which loads none: the flexgen deployments would be
unknown there. The plugin therefore swaps HELM's submit function for `submit_worker`, which
submits the same job with this module as its command: the worker loads the entry-point
plugins as helm-run does, and runs its run spec with the BatchingRunner (batches planned from
the scenario's request list, each batch cached as it ends, `flexgen_padding.json`). Each job
is one process, so it loads its deployment's model once. Before the first submission it
checks that Slurm answers and that `runner_config.yaml` names this cluster's partition (HELM's
built-in defaults are Stanford's), and says in one line what to do if not. A run whose job a
killed helm-run left running is followed, not submitted twice (slurm_orphans.py).
"""

from __future__ import annotations

import argparse
import importlib.abc
import shlex
import shutil
import subprocess
import sys

from helm.common.hierarchical_logger import setup_default_logging

from flexgen_helm.errors import ClusterError
from flexgen_helm.helm import slurm_orphans

HELM_WORKER = "helm.benchmark.slurm_runner"
START_HINT = ("start one here with `sudo cluster/local_slurm.sh start` and `export SLURM_CONF=...` as it prints, "
              "or on a cluster run helm-run on a login node")
PROBE_TIMEOUT_S = 10


def slurm_problem() -> str | None:
    """None when `sinfo` answers with at least one node; else one line saying which command
    failed and how to start Slurm."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return f"`sbatch` / `sinfo` not found on PATH: Slurm is not installed; {START_HINT}"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"`sinfo` got no answer within {PROBE_TIMEOUT_S} s: slurmctld is down or unreachable; {START_HINT}"
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"`sinfo` failed ({reason}): slurmctld is down or unreachable; {START_HINT}"
    if not done.stdout.split():
        return f"`sinfo` lists no nodes: Slurm has no partition to run jobs in; {START_HINT}"
    return None


def worker_command(helm_command: str) -> str:
    """HELM's worker command line with this module in place of HELM's worker module."""
    argv = shlex.split(helm_command)
    if argv[1:3] != ["-m", HELM_WORKER]:
        raise ClusterError(f"HELM's SlurmRunner submitted an unexpected command ({helm_command!r}); this "
                           f"crfm-helm is not one flexgen-helm knows how to run workers for")
    return shlex.join([argv[0], "-m", __name__, *argv[3:]])


def use_for_helm_slurm_runner() -> None:
    """Make HELM's SlurmRunner submit flexgen workers, from the moment HELM imports it.

    Not imported here: HELM's slurm_runner pulls in spacy and nltk, which every helm-run would
    import at plugin load though few use Slurm (about a second of each run's wall time on a
    2-core host: runs/bench/helm_run_startup). The swap is made when the module is imported
    (helm-run imports its runner class after the plugins), or now if it already is. Where
    crfm-helm's slurm extra (simple-slurm) is missing, that import raises HELM's own
    OptionalDependencyNotInstalled, which says what to install."""
    module = sys.modules.get(HELM_WORKER)
    if module is not None:
        _swap_submit(module)
    if not any(isinstance(finder, _SwapOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SwapOnImport())


class _SwapOnImport(importlib.abc.MetaPathFinder):
    """Finds HELM's slurm_runner as the finders after it do, with a loader that swaps its submit
    function once the module has run. It stays installed, so an import retried after a failure,
    or a reload, is swapped too."""

    def find_spec(self, name, path, target=None):
        if name != HELM_WORKER:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _SwapAfterRun(spec.loader)
                return spec
        return None


class _SwapAfterRun(importlib.abc.Loader):
    """The module's own loader, then the swap."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _swap_submit(module)

    def __getattr__(self, name):  # get_source (tracebacks), get_resource_reader, ...: the module's loader's
        return getattr(self.loader, name)


def _swap_submit(helm_slurm) -> None:
    if getattr(helm_slurm.submit_slurm_job, "__module__", None) == __name__:
        return
    helm_submit = helm_slurm.submit_slurm_job

    def submit_worker(command, slurm_args):
        problem = slurm_problem() or _runner_config_problem()
        if problem:
            raise ClusterError(problem)
        # HELM sets chdir (its cwd) and job_name (the run's name), each through shlex.quote
        chdir, run_name = (shlex.split(slurm_args[key])[0] for key in ("chdir", "job_name"))
        tag = slurm_orphans.tag_of_worker(command, chdir)
        followed = slurm_orphans.take_over(tag, run_name)
        if followed is not None:
            return followed
        return helm_submit(worker_command(command), {**slurm_args, "comment": tag})

    submit_worker.__module__ = __name__
    helm_slurm.submit_slurm_job = submit_worker


def _runner_config_problem() -> str | None:
    from helm.benchmark import runner_config_registry

    if runner_config_registry.RUNNER_CONFIG.slurm_args is None:
        return ("HELM's SlurmRunner has no slurm_args: its built-in ones are Stanford's cluster (account nlp, "
                "partition john); write <local path>/runner_config.yaml with this cluster's (e.g. "
                "cluster/runner_config.yaml, copied into prod_env/)")
    if "comment" in runner_config_registry.RUNNER_CONFIG.slurm_args:
        return ("runner_config.yaml's slurm_args sets `comment`, which flexgen-helm sets itself on each job (to find a "
                "run's job left by a helm-run that did not end, see slurm_orphans.py): remove it")
    return None


def main() -> None:
    """A worker job: HELM's worker arguments; the run spec runs with the BatchingRunner."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slurm-runner-spec-path", required=True)
    parser.add_argument("--run-spec-path", required=True)
    parser.add_argument("--log-config", default=None)
    args = parser.parse_args()
    setup_default_logging(args.log_config)

    from helm.benchmark.config_registry import (
        register_builtin_configs_from_helm_package,
        register_configs_from_directory,
    )
    from helm.benchmark.run import load_entry_point_plugins
    from helm.benchmark.runner import RunSpec
    from helm.benchmark.slurm_runner import SlurmRunnerSpec
    from helm.common.codec import from_json

    from flexgen_helm.helm.runner import BatchingRunner

    with open(args.slurm_runner_spec_path) as f:
        spec = from_json(f.read(), SlurmRunnerSpec)
    with open(args.run_spec_path) as f:
        run_spec = from_json(f.read(), RunSpec)
    # as helm-run does: HELM's configs, the user's prod_env, then the plugins (ours among them)
    register_builtin_configs_from_helm_package()
    if spec.execution_spec.local_path is not None:
        register_configs_from_directory(spec.execution_spec.local_path)
    load_entry_point_plugins()
    BatchingRunner(**spec.to_kwargs()).run_one(run_spec)


if __name__ == "__main__":
    main()
