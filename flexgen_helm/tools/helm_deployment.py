"""Serve a local checkpoint (a Hugging Face folder or a .gguf file of any family we read)
as a `flexgen/<name>` HELM deployment: the model_deployments, tokenizer_configs and
model_metadata entries that helm-run reads from its local path (`prod_env/` by default),
merged into the files there (an entry of the same name is replaced, others kept).

The deployment's tokenizer is the checkpoint's own; prompts are encoded as plain text
(flexgen_helm.helm.tokenizer never adds special tokens, and the client takes no chat
messages), so a chat model's chat template is not applied: completion scenarios see the
prompt HELM wrote, as with any base model."""

from __future__ import annotations

import datetime
from pathlib import Path

import yaml

from flexgen_helm.errors import FlexGenError
from flexgen_helm.models import family_of
from flexgen_helm.models.spec import all_store_tensors
from flexgen_helm.weights.convert import atomic_write
from flexgen_helm.weights.registry import resolve

FILES = {"model_deployments": "model_deployments.yaml", "tokenizer_configs": "tokenizer_configs.yaml",
         "models": "model_metadata.yaml"}


def deployment_entries(name: str, path: str | Path, policy: dict | None = None) -> dict[str, dict]:
    """The three entries (keyed by FILES' list names) of `flexgen/<name>` for the checkpoint at `path`."""
    if not name or "/" in name:
        raise FlexGenError(f"deployment name {name!r}: give the part after 'flexgen/' (no slash)")
    path = str(Path(path).resolve())
    resolved = resolve(name, path=path)  # fails here, naming the problem, on a checkpoint we cannot read
    cfg, tok = resolved.config, resolved.load_tokenizer()
    eos = tok.eos_token or (tok.convert_ids_to_tokens(cfg.eos_token_id) if cfg.eos_token_id is not None else None)
    if eos is None:
        raise FlexGenError(f"{path}: the tokenizer names no end-of-text token; HELM's tokenizer config needs one")
    full = f"flexgen/{name}"
    args = {"model": name, "path": path, "deployment": full, **({"policy": policy} if policy else {})}
    params = sum(t.numel for t in all_store_tensors(family_of(cfg).layer_specs(cfg)))
    return {
        "model_deployments": {
            "name": full, "model_name": full, "tokenizer_name": full,
            "max_sequence_length": cfg.max_seq_len, "max_request_length": cfg.max_seq_len,
            "max_sequence_and_generated_tokens_length": cfg.max_seq_len,
            "client_spec": {"class_name": "flexgen_helm.helm.client.FlexGenClient", "args": args}},
        "tokenizer_configs": {
            "name": full,
            "tokenizer_spec": {"class_name": "flexgen_helm.helm.tokenizer.FlexGenTokenizer",
                               "args": {"model": name, "path": path, "deployment": full}},
            "end_of_text_token": eos, "prefix_token": tok.bos_token or eos},
        "models": {
            "name": full, "display_name": f"{name} (FlexGen, local)",
            "description": f"{cfg.name} ({cfg.family} family, {cfg.num_layers} blocks) from {path}, run by the "
                           f"flexgen-helm offloading engine.",
            "creator_organization_name": "local", "access": "open", "num_parameters": params,
            "release_date": datetime.date.today(),
            "tags": ["TEXT_MODEL_TAG", "FULL_FUNCTIONALITY_TEXT_MODEL_TAG"]},
    }


def write_deployment(name: str, path: str | Path, local_path: str | Path = "prod_env",
                     policy: dict | None = None) -> list[Path]:
    """Merge `flexgen/<name>`'s entries into the YAML files under `local_path`."""
    entries = deployment_entries(name, path, policy)
    root = Path(local_path)
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for key, file in FILES.items():
        target = root / file
        doc = yaml.safe_load(target.read_text()) if target.is_file() else None
        doc = doc or {}
        kept = [e for e in doc.get(key) or [] if e.get("name") != entries[key]["name"]]
        doc[key] = kept + [entries[key]]
        atomic_write(target, yaml.safe_dump(doc, sort_keys=False))
        written.append(target)
    return written
