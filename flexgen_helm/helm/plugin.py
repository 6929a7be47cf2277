"""The HELM plugin entry point: importing this module registers everything.

HELM (crfm-helm >= 0.5.12) imports every object of the `helm` entry-point group at
the start of `helm-run` (helm.benchmark.run.load_entry_point_plugins), after its own
configs and the local `prod_env/` ones. Registered here:
  * model metadata, tokenizer configs and model deployments from the YAML files beside
    this module -- skipping names already registered, so that a user's
    prod_env/model_deployments.yaml entry of the same name (e.g. flexgen/opt-30b with a
    checkpoint path and a policy) wins;
  * the run spec functions `lambada` and `wikitext` (flexgen_helm.helm.run_specs);
  * the BatchingExecutor as HELM Runner's executor (scenario_executor.py): each scenario's
    flexgen requests run as one planned set of batches, whatever `-n`;
  * the GuardedOutputsRunner as plain helm-run's Runner (outputs_guard.py): a disk that
    fills while HELM writes a run's outputs ends helm-run with one line, no partial outputs;
  * flexgen workers for HELM's SlurmRunner (slurm.py): its jobs load the plugins and batch.
Import cost is kept to YAML parsing: torch and the engine load on the first request.
"""

from __future__ import annotations

import os
import threading

import cattrs
import dacite
import yaml
from helm.benchmark import model_deployment_registry as deployments
from helm.benchmark import model_metadata_registry as metadata
from helm.benchmark import tokenizer_config_registry as tokenizers

from flexgen_helm.torchvision_guard import hide_mismatched_torchvision

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOCK = threading.Lock()
_DONE = False


def _load(name: str) -> dict:
    with open(os.path.join(_HERE, name)) as f:
        return yaml.safe_load(f)


def _register_metadata() -> None:
    for m in dacite.from_dict(metadata.ModelMetadataList, _load("model_metadata.yaml")).models:
        existing = metadata.MODEL_NAME_TO_MODEL_METADATA.get(m.name)
        if existing is not None and existing.creator_organization_name != "Unknown":
            continue  # the user's own metadata for this name wins
        if existing is not None:  # HELM's placeholder, made for a deployment registered first
            m.deployment_names = existing.deployment_names
            metadata.ALL_MODELS_METADATA.remove(existing)
        metadata.register_model_metadata(m)


def _register_tokenizers() -> None:
    for t in cattrs.structure(_load("tokenizer_configs.yaml"), tokenizers.TokenizerConfigs).tokenizer_configs:
        if t.name not in tokenizers.TOKENIZER_NAME_TO_CONFIG:
            tokenizers.register_tokenizer_config(t)


def _register_deployments() -> None:
    for d in cattrs.structure(_load("model_deployments.yaml"), deployments.ModelDeployments).model_deployments:
        if d.name not in deployments.DEPLOYMENT_NAME_TO_MODEL_DEPLOYMENT:
            deployments.register_model_deployment(d)


def register() -> None:
    """Idempotent: registers once per process."""
    global _DONE
    with _LOCK:
        if _DONE:
            return
        # our install pins a torchvision that may not match the CPU torch; hidden, it cannot
        # break transformers (ours or HELM's HuggingFaceClient) in this helm-run
        hide_mismatched_torchvision()
        _register_metadata()  # before deployments, so they find their metadata
        _register_tokenizers()
        _register_deployments()
        import flexgen_helm.helm.run_specs  # noqa: F401  (registers run spec functions)
        from flexgen_helm.helm import outputs_guard, scenario_executor, slurm

        scenario_executor.use_for_plain_helm_run()
        outputs_guard.use_for_plain_helm_run()
        slurm.use_for_helm_slurm_runner()

        _DONE = True


register()
