"""A HELM Executor that hands all the requests of a scenario to the engine at once.

HELM's executor sends one request per thread; FlexGen wants every request of a run up
front, to fill big batches of similar-length prompts (the paper ran HELM this way).
`BatchingExecutor.execute` first gives each flexgen deployment's client the whole list
(`FlexGenClient.prefetch`: length-bucketed batches planned from the list alone, so the
results do not depend on `-n`, each batch in HELM's cache as soon as it ends), then lets
HELM's own executor run as usual: each request finds its result ready and goes through
HELM's error handling; non-flexgen deployments are untouched.

Imports no torch (the plugin imports this module when helm-run starts).
"""

from __future__ import annotations

from helm.benchmark.adaptation.scenario_state import ScenarioState
from helm.benchmark.executor import Executor
from helm.common.hierarchical_logger import hlog, htrack_block

from flexgen_helm.errors import DiskFullError


class BatchingExecutor(Executor):
    def execute(self, scenario_state: ScenarioState) -> ScenarioState:
        if not self.execution_spec.dry_run:
            try:
                self.prefetch(scenario_state)
            except DiskFullError as e:
                # Nothing more can be computed or kept until space is freed, in this run or the
                # next: end helm-run with the one line that says so (every finished batch is in
                # HELM's cache, so the same command resumes there).
                raise SystemExit(f"flexgen-helm: error: {e}") from e
        return super().execute(scenario_state)

    def prefetch(self, scenario_state: ScenarioState) -> None:
        from flexgen_helm.helm.client import FlexGenClient

        auto_client = getattr(self.context, "client", None)  # LocalContext's AutoClient
        # AutoClient has no public way to reach the client it routes a deployment's requests
        # to, and the prefetched results must land in that very client: its private
        # _get_client (crfm-helm 0.5.12-0.5.16) is the only way in. Checked, so that a HELM
        # without it runs the requests one by one instead of failing.
        if auto_client is None or not hasattr(auto_client, "_get_client"):
            hlog("flexgen: no local AutoClient (remote server?); requests go one by one")
            return
        by_deployment: dict[str, list] = {}
        for rs in scenario_state.request_states:
            by_deployment.setdefault(rs.request.model_deployment, []).append(rs.request)
        for deployment, requests in by_deployment.items():
            if not _is_flexgen(deployment):
                continue  # built (and its requests sent) by HELM as usual
            client = auto_client._get_client(deployment)
            if isinstance(client, FlexGenClient):
                with htrack_block(f"flexgen: batching {len(requests)} requests of {deployment}"):
                    n = self.prefetch_client(client, requests)
                    hlog(f"flexgen: computed {n} uncached requests")

    def prefetch_client(self, client, requests) -> int:
        return client.prefetch(requests)


def _is_flexgen(deployment: str) -> bool:
    from helm.benchmark.model_deployment_registry import get_model_deployment

    try:
        spec = get_model_deployment(deployment).client_spec
    except ValueError:  # unknown deployment: HELM's own error comes with its first request
        return False
    return spec.class_name == FLEXGEN_CLIENT


FLEXGEN_CLIENT = "flexgen_helm.helm.client.FlexGenClient"


def use_for_plain_helm_run() -> None:
    """Make HELM's Runner build this executor (plain `helm-run`, no --runner-class-name).

    HELM's Runner has no option for its executor class: it calls the `Executor` name it
    imported, which is set here. Requests of other deployments go through HELM's executor
    unchanged; flexgen deployments get their scenario batched whole, which makes `-n`
    change neither the batches nor the results, and lets a killed run resume by batch."""
    import helm.benchmark.runner as helm_runner

    if helm_runner.Executor is Executor:
        helm_runner.Executor = BatchingExecutor
