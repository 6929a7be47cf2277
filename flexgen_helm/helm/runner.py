"""A HELM Runner for flexgen deployments.

    helm-run --runner-class-name flexgen_helm.helm.runner.BatchingRunner ...

It runs each scenario through the BatchingExecutor (scenario_executor.py; plain helm-run
does too, see plugin.py), writes the padding summary next to HELM's outputs as
`flexgen_padding.json` (see accounting.py), and turns a scenario download that fails on
an offline machine into one clear error; a disk that fills while HELM writes its outputs
gives one too (outputs_guard.py, which plain helm-run uses as well).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from urllib.error import URLError

from helm.benchmark.metrics.metric_service import MetricService
from helm.benchmark.window_services.tokenizer_service import TokenizerService

from flexgen_helm.errors import DataUnreachableError
from flexgen_helm.helm import accounting
from flexgen_helm.helm.outputs_guard import GuardedOutputsRunner
from flexgen_helm.helm.scenario_executor import BatchingExecutor

PADDING_SUMMARY = "flexgen_padding.json"  # beside HELM's outputs of a run
_NETWORK_ERRORS = (URLError, socket.gaierror, ConnectionError, TimeoutError)
_DOWNLOADERS = ("wget", "gdown", "curl")
_SHELL_FAILURE = re.compile(r"Failed with exit code (\d+): (\S+)")


def download_failure(error: BaseException) -> str | None:
    """The network failure somewhere in `error`'s chain of causes, described; else None.

    HELM's scenarios download their data on first use (urllib, or wget / gdown in a
    subprocess) and report an offline machine as whatever that tool raised, deep in a
    traceback, after which the run is lost anyway: better to say so in one line."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, _NETWORK_ERRORS):
            return f"{type(error).__name__}: {error}"
        if isinstance(error, subprocess.CalledProcessError):
            cmd = error.cmd if isinstance(error.cmd, str) else " ".join(map(str, error.cmd))
            if os.path.basename(cmd.split()[0]) in _DOWNLOADERS:
                return f"`{cmd}` exited with {error.returncode}"
        failed_tool = _SHELL_FAILURE.match(str(error))  # helm.common.general.shell's own exception
        if failed_tool and os.path.basename(failed_tool[2]) in _DOWNLOADERS:
            return str(error)
        error = error.__cause__ or error.__context__
    return None


class BatchingRunner(GuardedOutputsRunner):
    executor_class = BatchingExecutor

    def __init__(self, execution_spec, *args, **kwargs):
        super().__init__(execution_spec, *args, **kwargs)
        # HELM's Runner builds the `Executor` its module names, with no hook to choose the
        # class; the plugin makes that the BatchingExecutor (scenario_executor.py). Any other
        # (a subclass's executor_class, or no plugin): build ours, and on its context again the
        # two services HELM built on the first one (tokenizer, metrics), so that one context
        # serves the whole run (the clients, with their prefetched results, live in it).
        if type(self.executor) is not self.executor_class:
            self.executor = self.executor_class(execution_spec)
            self.tokenizer_service = TokenizerService(self.executor.context)
            self.metric_service = MetricService(self.executor.context)

    def run_one(self, run_spec):
        try:
            super().run_one(run_spec)
        except Exception as e:
            cause = download_failure(e)
            if cause is None:
                raise
            raise DataUnreachableError(
                f"{run_spec.name}: the scenario's data could not be downloaded ({cause}); this machine cannot "
                f"reach its source. Run it where the source is reachable, or place the files HELM downloads "
                f"under {os.path.join(self.output_path, 'scenarios')}/<scenario name>/ first."
            ) from e
        run_path = os.path.join(self.runs_path, run_spec.name)  # where HELM's Runner writes the run
        if os.path.exists(os.path.join(run_path, "scenario_state.json")):
            summary = accounting.summarize_run(run_path)
            with self.whole_outputs(run_spec, PADDING_SUMMARY), open(os.path.join(run_path, PADDING_SUMMARY), "w") as f:
                json.dump(summary, f, indent=2)
