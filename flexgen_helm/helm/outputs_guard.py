"""HELM's Runner with each run's outputs written whole or not at all.

HELM's Runner writes a run's outputs (HELM_RUN_OUTPUTS) one after the other. A disk that
fills meanwhile leaves some of them, the last cut short, and HELM logs its traceback and
goes on with the next run, which fails the same way. `GuardedOutputsRunner` ends helm-run at
the first full disk with one line (the DiskFullError's: the path, what is free, what to do)
and deletes the run's outputs so far, which would pass for a finished run next time. The
plugin makes it plain helm-run's Runner (`use_for_plain_helm_run`); the BatchingRunner
derives from it.

Imports no torch (the plugin imports this module when helm-run starts).
"""

from __future__ import annotations

import contextlib
import os

from helm.benchmark.runner import Runner

from flexgen_helm.memory.disk_space import disk_full, is_disk_full

# what HELM's Runner.run_one writes into a run's folder, in order
HELM_RUN_OUTPUTS = ("run_spec.json", "scenario.json", "scenario_state.json", "stats.json", "per_instance_stats.json")


class GuardedOutputsRunner(Runner):
    def run_one(self, run_spec):
        with self.whole_outputs(run_spec):
            super().run_one(run_spec)

    @contextlib.contextmanager
    def whole_outputs(self, run_spec, *more_outputs: str):
        """Inside it, a full disk deletes the run's outputs (HELM's and `more_outputs`) and
        ends helm-run with one line."""
        try:
            yield
        except OSError as e:
            if not is_disk_full(e):
                raise
            run_path = os.path.join(self.runs_path, run_spec.name)
            for name in (*HELM_RUN_OUTPUTS, *more_outputs):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(run_path, name))
            error = disk_full(run_path, None, f"HELM's outputs of {run_spec.name}",
                              "free space and run the same command again: its requests are in HELM's cache")
            # SystemExit, not an error that HELM's run_all would log with its traceback and go on from
            raise SystemExit(f"flexgen-helm: error: {error}") from e


def use_for_plain_helm_run() -> None:
    """Make plain `helm-run` (no --runner-class-name) build a GuardedOutputsRunner.

    helm-run builds the `Runner` its module imported unless told another class; the plugin
    is imported before that, and sets the name here."""
    import helm.benchmark.run as helm_run

    if helm_run.Runner is Runner:
        helm_run.Runner = GuardedOutputsRunner
